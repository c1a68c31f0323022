"""KV-cache groups (model/kv_groups.py): Gemma 2 (sliding and global layers alternating, two
groups of two layers) and Gemma 3 (two sliding layers to one global: three groups of two)
hold a block table per group, one cache tensor per place in a group; the windowed groups
release the blocks that fall out of the window while the global group keeps them. Greedy
outputs stay token-identical to HF transformers in float32 with prefix hits, chunked
prefill, overlapped steps, n > 1, preemption and speculative decoding, and the same memory
holds more blocks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_hf_parity import hf_greedy
from test_models_gemma_phi import BASE

from paged import LLM, SamplingParams
from paged.engine.kv_cache import KVCacheManager
from paged.engine.request import Request
from paged.model.attention import AttentionMetadata
from paged.model.kv_groups import kv_groups, one_group
from paged.model.kv_window import window_blocks_needed
from paged.sampling.params import SamplingParams as Params
from paged.scheduled import ScheduledBatch
from paged.worker.input_buffers import InputBuffers

BLOCK, WINDOW, CHUNK, MAX_TOKENS, MAX_LEN = 4, 10, 16, 16, 128
SHARED = list(range(5, 45))  # ten full blocks two prompts share
PROMPTS = [SHARED + list(range(60, 70)), SHARED + list(range(80, 87)), list(range(100, 170))]
GEMMA3_TYPES = ["sliding_attention"] * 2 + ["full_attention"]
KINDS = {"gemma2": [None, WINDOW], "gemma3": [None, WINDOW, WINDOW]}  # the groups' windows
# A whole sequence of the long prompt (70 + 16 tokens) in blocks; a windowed group's bound.
FULL = -(-(len(PROMPTS[2]) + MAX_TOKENS) // BLOCK)
BOUND = -(-(WINDOW - 1 + CHUNK) // BLOCK) + 1


def build(kind: str, path: str) -> str:
    """A tiny random Gemma 2 (4 layers) or Gemma 3 (6 layers) saved to `path`, initialised as
    test_models_gemma_phi's (far from greedy ties)."""
    import transformers as tf

    if kind == "gemma2":
        cfg = tf.Gemma2Config(**{**BASE, "num_hidden_layers": 4}, head_dim=16,
                              sliding_window=WINDOW, query_pre_attn_scalar=24,
                              attn_logit_softcapping=4.0, final_logit_softcapping=6.0)  # fmt: skip
    else:
        cfg = tf.Gemma3TextConfig(**{**BASE, "num_hidden_layers": 6}, head_dim=16,
                                  sliding_window=WINDOW, layer_types=GEMMA3_TYPES * 2,
                                  query_pre_attn_scalar=32)  # fmt: skip
        cfg.architectures = ["Gemma3ForCausalLM"]
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embed_tokens" in name:
                p.normal_(0, 0.03)
            elif p.dim() > 1:
                p.normal_(0, 0.2)
            elif "norm" in name:
                p.uniform_(-0.5, 0.5)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("kv_groups")
    return {kind: build(kind, str(root / kind)) for kind in KINDS}


@pytest.fixture(scope="module")
def expected(models) -> dict[str, list[list[int]]]:
    from transformers import AutoModelForCausalLM

    out = {}
    for kind, path in models.items():
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        out[kind] = [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]
        wide = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                    sliding_window=4096).eval()  # fmt: skip
        assert hf_greedy(wide, PROMPTS[2], MAX_TOKENS) != out[kind][2]  # the window matters
    return out


def make_llm(path: str, **kw) -> LLM:
    llm = LLM(path, dtype="float32", block_size=BLOCK, max_num_batched_tokens=CHUNK,
              max_model_len=MAX_LEN, **kw)  # fmt: skip
    null = llm.engine.kv.null_block
    for cache in llm.engine.runner.kv_caches if null is not None else ():
        # [2, kv_heads, blocks, ...]: wrong tokens if a query attends to it. Not NaN: the
        # CPU backend's torch decode reads the table padding (block 0) of a global layer's
        # shorter rows, masked, and 0 * NaN would be NaN.
        cache[:, :, null] = 1e4
    return llm


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def assert_nothing_leaked(kv: KVCacheManager) -> None:
    kv.check_invariants([])
    assert kv.num_free_blocks == kv.num_usable_blocks


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["sync", "overlap", "small-pool", "ngram", "draft"])
def test_matches_hf_and_releases_per_group(models, expected, kind, mode):
    kw: dict = {"num_kv_blocks": 96}
    if mode == "overlap":
        kw["async_scheduling"] = True
    if mode == "ngram":  # lookahead slots in every group, given back per group
        kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 3}
    if mode == "draft":  # the model drafting for itself, on the first (global) group's tables
        kw["speculative_config"] = {"model": models[kind], "num_speculative_tokens": 3}
    if mode == "small-pool":  # the fewest blocks one request of max_model_len may need
        windowed = (len(KINDS[kind]) - 1) * (window_blocks_needed(WINDOW, BLOCK, CHUNK) - 1)
        kw = {"num_kv_blocks": MAX_LEN // BLOCK + windowed + 1}
    llm = make_llm(models[kind], **kw)
    try:
        kv = llm.engine.kv
        assert kv.windows == KINDS[kind] and kv.window is None and kv.null_block == 0
        assert len(llm.engine.runner.kv_caches) == 2  # one tensor per place in a group
        if mode == "small-pool":  # all at once: preempted, recomputed
            assert greedy(llm, PROMPTS) == expected[kind]
            assert llm.engine.scheduler.num_preemptions > 0
        else:  # the first prompt's blocks are cached before the second (same prefix) comes
            outs = greedy(llm, PROMPTS[:1]) + greedy(llm, PROMPTS[1:])
            assert outs == expected[kind]
            assert kv.hits >= 8 * BLOCK
        assert kv.num_window_released > 0
        lag = CHUNK // BLOCK if mode == "overlap" else 0  # registered a step late
        assert kv.peak_group_blocks[0] == FULL  # the global group keeps every block
        ahead = 3 // BLOCK + 1 if mode in ("ngram", "draft") else 0  # lookahead slots
        assert all(n <= BOUND + lag + ahead < FULL for n in kv.peak_group_blocks[1:])
        if mode == "draft":  # every proposal accepted
            stats = llm.engine.metrics()
            assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"]
        assert_nothing_leaked(kv)
        if mode == "sync":  # n > 1: forks share every group's blocks; equal to seeded singles
            sample = dict(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True)
            prompt = {"prompt_token_ids": PROMPTS[2]}
            forked = llm.generate(prompt, SamplingParams(n=3, seed=7, **sample), use_tqdm=False)
            singles = llm.generate([prompt] * 3, [SamplingParams(seed=7 + i, **sample)
                                                  for i in range(3)], use_tqdm=False)  # fmt: skip
            samples = [o.token_ids for o in forked[0].outputs]
            assert len({tuple(t) for t in samples}) > 1
            assert samples == [o.outputs[0].token_ids for o in singles]
            assert_nothing_leaked(kv)
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_parallel_ranks_read_every_groups_tables(models, expected, tp, pp):
    """The other rank (gloo, CPU) gets every group's tables in the step's packed inputs; a
    pipeline stage allocates the cache tensors of its own layers' places."""
    small = MAX_LEN // BLOCK + window_blocks_needed(WINDOW, BLOCK, CHUNK)  # preempts
    llm = make_llm(models["gemma2"], num_kv_blocks=small, tensor_parallel_size=tp,
                   pipeline_parallel_size=pp)  # fmt: skip
    try:
        assert greedy(llm, PROMPTS) == expected["gemma2"]
        kv = llm.engine.kv
        assert kv.num_window_released > 0 and llm.engine.scheduler.num_preemptions > 0
        assert len(llm.engine.runner.kv_caches) == 2 // pp
        assert_nothing_leaked(kv)
    finally:
        llm.engine.shutdown()


def test_same_memory_holds_more_blocks(models, monkeypatch):
    """Gemma 3's three groups of two layers: a block id costs two layers, not six, so the same
    --kv-cache-memory holds three times the blocks; a long sequence holds fewer layer-blocks."""
    path = models["gemma3"]
    llm = make_llm(path, kv_cache_memory="3MiB")  # a block: 1 KiB a layer
    try:
        grouped, kv = llm.engine.num_blocks, llm.engine.kv
        greedy(llm, PROMPTS[2:])
        held = sum(kv.peak_group_blocks) * 2  # blocks x layers per group
    finally:
        llm.engine.shutdown()
    monkeypatch.setattr("paged.worker.model_runner.kv_groups", one_group)  # every block kept
    llm = make_llm(path, kv_cache_memory="3MiB")
    try:
        assert llm.engine.kv.windows == [None] and len(llm.engine.runner.kv_caches) == 6
        assert grouped == 3 * llm.engine.num_blocks == 3 * 512
        assert held < FULL * 6
    finally:
        llm.engine.shutdown()


# ---- the grouping ----------------------------------------------------------------------


def fake_model(types: list[str], window: int = 4) -> tuple[SimpleNamespace, list]:
    cfg = SimpleNamespace(num_hidden_layers=len(types), sliding_window=window, layer_types=types)
    layers = [SimpleNamespace(self_attn=SimpleNamespace(
        kv_group=0, attn_opts={"window": window} if t == "sliding_attention" else {}))
        for t in types]  # fmt: skip
    return cfg, layers


def test_layers_grouped_by_window():
    s, f = "sliding_attention", "full_attention"
    cfg, layers = fake_model([s, s, f] * 2)
    groups = kv_groups(cfg, layers, 64)
    assert groups.windows == (None, 4, 4) and groups.layers == ((2, 5), (0, 1), (3, 4))
    assert groups.place(3) == (2, 0) and groups.place(5) == (0, 1) and groups.size == 2
    # Gemma 3 1B: 26 layers, every sixth global (22 : 4) -> 13 groups of 2
    cfg, layers = fake_model([s if (i + 1) % 6 else f for i in range(26)])
    assert len(kv_groups(cfg, layers, 64)) == 13
    # 29 : 5 -> groups of one layer, more than MAX_KV_GROUPS: one group keeping every block
    cfg, layers = fake_model([s if (i + 1) % 6 else f for i in range(34)])
    assert kv_groups(cfg, layers, 64).windows == (None,)
    # A pipeline stage's layers (the 4th..6th) place by the model's numbering
    cfg, layers = fake_model([s, s, f] * 2)
    assert kv_groups(cfg, layers[3:], 64, start_layer=3).layers[2] == (3, 4)
    # One window everywhere, none, or an attention without kv_group: one group
    cfg, layers = fake_model([s] * 4)
    assert kv_groups(cfg, layers, 64).windows == (4,)
    cfg, layers = fake_model([f] * 4)
    assert kv_groups(cfg, layers, 64).windows == (None,)
    cfg, layers = fake_model([s, f])
    del layers[0].self_attn.kv_group
    assert kv_groups(cfg, layers, 64).windows == (None,)
    # Blocks one request of 64 tokens needs: the global group's 16, the windowed one's
    # window bound, the null block.
    cfg, layers = fake_model([s, f])
    assert kv_groups(cfg, layers, 64).blocks_needed(64, 4, 4) == 16 + (-(-11 // 4) + 2) + 1


# ---- the grouped block manager -------------------------------------------------------


def req(rid: str, ids: list[int]) -> Request:
    return Request(rid, ids, Params())


def advance(kv: KVCacheManager, r: Request, n: int, hit=None) -> None:
    """Schedule, compute and register `n` more tokens of `r`, as a step does."""
    start = len(hit[0]) * kv.block_size if hit else r.num_computed_tokens
    assert kv.allocate(r, start + n, hit)
    r.num_computed_tokens = start + n
    kv.cache_full_blocks(r)


def test_grouped_manager_releases_hits_and_forks():
    kv = KVCacheManager(40, 4, group_windows=[None, 6])
    null = kv.null_block
    a = req("a", list(range(30)))
    for _ in range(7):
        advance(kv, a, 4)
    assert kv.allocate(a, 29)  # the next query (position 28) reads keys >= 23: blocks 5..
    glob, win = a.group_block_ids
    assert null not in glob and len(glob) == len(win) == 8  # the global group keeps all
    assert win[:5] == [null] * 5 and null not in win[5:] and not set(glob) & set(win)
    assert kv.num_window_released == 5 and kv.peak_group_blocks == [8, 3]
    kv.check_invariants([a])
    # The same 28 tokens: every global block, the windowed group's window (its blocks 5, 6).
    b = req("b", list(range(28)) + [99, 98])
    hit = kv.find_hit(b)
    assert [blk.block_id for blk in hit[0]] == glob[:7]
    assert hit[1][:5] == [None] * 5 and [blk.block_id for blk in hit[1][5:]] == win[5:7]
    assert [blk.block_id for blk in kv.find_cached(b)] == glob[:7]  # the first group's
    advance(kv, b, 2, hit)
    assert b.group_block_ids[1][:5] == [null] * 5 and kv.blocks[win[5]].ref_cnt == 2
    # The windowed group lost block 6 (evicted): the hit ends where its window is whole again
    # (6 blocks: keys from 19 on, its released blocks 4 and 5 still cached).
    del kv.cached[kv.blocks[win[6]].hash]
    kv.blocks[win[6]].hash = None
    hit = kv.find_hit(req("c", list(range(28)) + [5, 5]))
    assert len(hit[0]) == len(hit[1]) == 6 and hit[1][:4] == [None] * 4
    # The global group lost block 2: no hit past it, whatever the windowed group holds.
    del kv.cached[kv.blocks[glob[2]].hash]
    kv.blocks[glob[2]].hash = None
    assert [len(h) for h in kv.find_hit(req("d", list(range(28)) + [5, 5]))] == [2, 2]
    # n > 1: a fork shares both groups' blocks; writing its shared last block copies it in
    # each group (copy on write).
    p = req("p", list(range(50, 60)))
    advance(kv, p, 10)
    f = req("f", list(p.token_ids))
    kv.fork(p, f)
    kv.check_invariants([a, b, p, f])
    f.num_computed_tokens = 10
    f.token_ids.append(7)
    assert kv.allocate(f, 11)
    assert len(kv.take_copies()) == 2
    kv.check_invariants([a, b, p, f])
    # Lookahead slots given back in every group; preemption frees every group.
    assert kv.allocate(f, 20)
    kv.trim(f, 11)
    assert [len(ids) for ids in f.group_block_ids] == [3, 3]
    for r in (a, b, p, f):
        kv.free_request(r)
    assert_nothing_leaked(kv)


def test_grouped_allocation_counts_every_group():
    kv = KVCacheManager(9, 4, enable_prefix_caching=False, group_windows=[None, 5])
    a = req("a", list(range(20)))
    assert not kv.allocate(a, 20)  # five blocks in each group: ten, eight are free
    assert a.group_block_ids == [[], []] and kv.num_free_blocks == 8
    assert kv.allocate(a, 16)
    a.num_computed_tokens = 16
    assert kv.allocate(a, 17)  # released out of the window (keys >= 12) before it counts
    assert a.group_block_ids[1][:3] == [0] * 3 and kv.num_free_blocks == 8 - 10 + 3
    kv.free_request(a)
    assert_nothing_leaked(kv)


# ---- the step's inputs per group ---------------------------------------------------------


def test_input_buffers_pack_a_table_and_slots_per_group():
    bufs = InputBuffers(16, 4, 8, 4, torch.device("cpu"), False, num_groups=2)
    a, b = req("a", list(range(6))), req("b", list(range(3)))
    a.group_block_ids, b.group_block_ids = [[1, 2], [0, 3]], [[4], [5]]
    a.num_computed_tokens = 5
    _, _, meta, _, _ = bufs.pack(ScheduledBatch([a, b], [1, 3], 1))
    assert meta.block_tables.tolist() == [[1, 2], [4, 0]]
    assert meta.group(1).block_tables.tolist() == [[0, 3], [5, 0]]
    assert meta.slot_mapping.tolist() == [9, 16, 17, 18]
    assert meta.group(1).slot_mapping.tolist() == [13, 20, 21, 22]
    assert meta.group(1).seq_lens.tolist() == [6, 3]


def test_graph_replay_reads_each_groups_static_buffers():
    from test_graph_runner import make_runner

    class GroupEcho(torch.nn.Module):
        """Each row's slot and first block in group 1 (what a captured graph reads)."""

        def forward(self, input_ids, positions, meta):
            from test_graph_runner import FakeGraph

            def compute():
                view = meta.group(1)
                return torch.stack([view.slot_mapping, view.block_tables[:, 0].long()], -1)

            out = compute()
            if FakeGraph.recording is not None:
                FakeGraph.recording.ops.append(lambda: out.copy_(compute()))
            return out

    runner, _ = make_runner()
    runner.model, runner.num_kv_groups = GroupEcho(), 2
    runner.capture()
    n = 3
    meta = AttentionMetadata(
        num_reqs=n, num_decodes=n, num_tokens=n,
        query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        seq_lens=torch.full((n,), 9, dtype=torch.int32),
        block_tables=torch.tensor([[1], [2], [3]], dtype=torch.int32),
        slot_mapping=torch.tensor([4, 5, 6]), max_query_len=1, max_seq_len=64,
    )  # fmt: skip
    meta.group_views = [
        AttentionMetadata(**{**meta.__dict__, "block_tables": meta.block_tables + 10,
                             "slot_mapping": meta.slot_mapping + 40, "group_views": []})
    ]  # fmt: skip
    out = runner.forward(torch.arange(n), torch.arange(n), meta)
    assert runner.graphs[4][0].replays == 1  # padded to a captured size of 4
    assert out.tolist() == [[44, 11], [45, 12], [46, 13]]
    assert runner.group_slots[1][3].item() == -1  # the padding row writes nowhere
