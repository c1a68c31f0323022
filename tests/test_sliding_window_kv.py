"""Sliding-window KV release: a model whose every layer is windowed releases the blocks that
fall out of the window as its sequences advance (the block table keeps the null block there),
prefix hits need only the blocks within the window, and outputs stay token-identical to HF
transformers in float32 with chunked prefill, prefix caching, overlapped steps and
preemption. Models with a global layer get a KV-cache group per window (test_kv_groups.py)."""

from __future__ import annotations

import pytest
import torch
from test_hf_parity import hf_greedy
from test_models_gemma_phi import BASE, make_model
from tiny_hf import spread_weights

from paged import LLM, SamplingParams
from paged.engine.kv_cache import KVCacheManager
from paged.engine.request import Request
from paged.model.kv_window import window_blocks_needed
from paged.sampling.params import SamplingParams as Params

WINDOW, BLOCK, CHUNK, MAX_TOKENS = 24, 8, 16, 40
SHARED = list(range(5, 53))  # 48 tokens: six full blocks two prompts share
PROMPTS = [SHARED + list(range(60, 74)), SHARED + list(range(80, 93)), list(range(100, 165))]


@pytest.fixture(scope="module")
def mistral(tmp_path_factory) -> str:
    import transformers as tf

    path = str(tmp_path_factory.mktemp("swa") / "mistral")
    torch.manual_seed(0)
    model = tf.MistralForCausalLM(tf.MistralConfig(**BASE, sliding_window=WINDOW)).eval()
    spread_weights(model)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def expected(mistral) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(mistral, dtype=torch.float32).eval()
    expect = [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]
    wide = AutoModelForCausalLM.from_pretrained(mistral, dtype=torch.float32,
                                                sliding_window=4096).eval()  # fmt: skip
    assert hf_greedy(wide, PROMPTS[2], MAX_TOKENS) != expect[2]  # the window matters
    return expect


def run(path: str, together: bool = False, **kw) -> tuple[list[list[int]], LLM]:
    llm = LLM(path, dtype="float32", block_size=BLOCK, max_num_batched_tokens=CHUNK,
              max_model_len=128, **kw)  # fmt: skip
    for cache in llm.engine.runner.kv_caches:  # [2, kv_heads, blocks, ...]: NaN if ever read
        cache[:, :, llm.engine.kv.null_block] = float("nan")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    if together:
        outs = llm.generate(prompts, params, use_tqdm=False)
    else:  # the first one's blocks are cached before the second one (same prefix) arrives
        outs = llm.generate(prompts[:1], params, use_tqdm=False)
        outs += llm.generate(prompts[1:], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


# A whole sequence (65 + 40 tokens) would hold 14 blocks; the window bounds it.
FULL = -(-(len(PROMPTS[2]) + MAX_TOKENS) // BLOCK)
BOUND = -(-(WINDOW - 1 + CHUNK) // BLOCK) + 1


@pytest.mark.parametrize(
    "kw",
    [
        {"num_kv_blocks": 40},
        {"num_kv_blocks": 40, "async_scheduling": True},
        # Fewer blocks than one sequence of max_model_len needs without the window; three
        # sequences at once do not fit: preemption. No prefix caching: released at once.
        {
            "num_kv_blocks": window_blocks_needed(WINDOW, BLOCK, CHUNK),
            "enable_prefix_caching": False,
        },  # fmt: skip
    ],
    ids=["sync", "overlap", "small-pool"],
)
def test_matches_hf_and_releases_blocks(mistral, expected, kw):
    small = kw["num_kv_blocks"] < 40
    outs, llm = run(mistral, together=small, **kw)
    try:
        kv = llm.engine.kv
        assert outs == expected
        assert kv.window == WINDOW and kv.null_block is not None
        assert kv.num_window_released > 0
        assert llm.engine.metrics()["kv_window_released_blocks"] == kv.num_window_released
        lag = CHUNK // BLOCK if kw.get("async_scheduling") else 0  # registered a step late
        assert kv.peak_seq_blocks <= BOUND + lag < FULL
        if "async_scheduling" not in kw and not small:
            assert kv.hits >= 3 * BLOCK  # the shared prefix hit, its window's blocks cached
        kv.check_invariants([])
        assert kv.num_free_blocks == kv.num_usable_blocks  # nothing leaked
        if small:
            assert llm.engine.scheduler.num_preemptions > 0 and kv.hits == 0
        if "async_scheduling" not in kw and not small:
            # n > 1: the samples share the prompt's live blocks and its null positions, and
            # each releases its own as it advances; equal to seeded singles.
            sample = dict(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True)
            prompt = {"prompt_token_ids": PROMPTS[2]}
            forked = llm.generate(prompt, SamplingParams(n=3, seed=7, **sample), use_tqdm=False)
            singles = llm.generate([prompt] * 3, [SamplingParams(seed=7 + i, **sample)
                                                  for i in range(3)], use_tqdm=False)  # fmt: skip
            samples = [o.token_ids for o in forked[0].outputs]
            assert len({tuple(t) for t in samples}) > 1
            assert samples == [o.outputs[0].token_ids for o in singles]
            kv.check_invariants([])
            assert kv.num_free_blocks == kv.num_usable_blocks
    finally:
        llm.engine.shutdown()


def test_mixtral_window_releases_blocks(tmp_path):
    """Mixture-of-experts layers under the same window: released, equal to HF."""
    import transformers as tf

    cfg = tf.MixtralConfig(**{**BASE, "intermediate_size": 48}, num_local_experts=4,
                           num_experts_per_tok=2, sliding_window=12)  # fmt: skip
    torch.manual_seed(1)
    hf = tf.MixtralForCausalLM(cfg).eval()
    spread_weights(hf)
    hf.save_pretrained(tmp_path / "mixtral")
    prompts = [list(range(5, 47)), list(range(100, 150))]
    expect = [hf_greedy(hf, p, 10) for p in prompts]
    llm = LLM(str(tmp_path / "mixtral"), dtype="float32", block_size=4, max_num_batched_tokens=16,
              num_kv_blocks=32, max_model_len=128)  # fmt: skip
    try:
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expect
        kv = llm.engine.kv
        assert kv.window == 12 and kv.num_window_released > 0
        kv.check_invariants([])
        assert kv.num_free_blocks == kv.num_usable_blocks
    finally:
        llm.engine.shutdown()


def test_global_layer_gets_its_own_group(tmp_path):
    """Qwen2 with one global layer (max_window_layers): two KV-cache groups, only the sliding
    one releases."""
    path = make_model("qwen2_sliding", str(tmp_path / "qwen2"))
    llm = LLM(path, dtype="float32", num_kv_blocks=64, max_model_len=128)
    try:
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        llm.generate([{"prompt_token_ids": PROMPTS[2]}], params, use_tqdm=False)
        kv = llm.engine.kv
        assert kv.window is None and kv.windows == [None, 8] and kv.num_window_released > 0
        kv.check_invariants([])
    finally:
        llm.engine.shutdown()


# ---- the block manager alone -----------------------------------------------------------


def req(rid: str, ids: list[int]) -> Request:
    return Request(rid, ids, Params())


def advance(kv: KVCacheManager, r: Request, n: int, cached=None) -> None:
    """Schedule, compute and register `n` more tokens of `r`, as a step does."""
    start = len(cached) * kv.block_size if cached else r.num_computed_tokens
    assert kv.allocate(r, start + n, cached)
    r.num_computed_tokens = start + n
    kv.cache_full_blocks(r)


def test_release_hit_and_fork():
    kv = KVCacheManager(32, 4, window=6)
    a = req("a", list(range(30)))
    for _ in range(7):
        advance(kv, a, 4)
    assert kv.allocate(a, 29)  # the next query (position 28) reads keys >= 23: blocks 5..
    assert a.block_ids[:5] == [kv.null_block] * 5 and kv.null_block not in a.block_ids[5:]
    assert kv.num_window_released == 5 and kv.peak_seq_blocks == 3  # keys 23-28: blocks 5-7
    kv.check_invariants([a])
    # Released blocks stay cached: a prompt with the same 28 tokens hits 7 blocks but holds
    # only those within its first query's window (5 and 6, shared), the null block before.
    b = req("b", list(range(28)) + [99, 98])
    hit = kv.find_cached(b)
    assert len(hit) == 7 and hit[:5] == [None] * 5
    assert [blk.block_id for blk in hit[5:]] == a.block_ids[5:7]
    advance(kv, b, 2, hit)
    assert b.block_ids[:5] == [kv.null_block] * 5 and kv.blocks[a.block_ids[5]].ref_cnt == 2
    # Diverging in block 5: a hit of 5 blocks takes released ones (3 and 4) back from the
    # free list.
    c = req("c", list(range(20)) + [7] * 6)
    hit = kv.find_cached(c)
    assert len(hit) == 5 and hit[:3] == [None] * 3 and all(blk.ref_cnt == 0 for blk in hit[3:])
    advance(kv, c, 1, hit)
    kv.check_invariants([a, b, c])
    # Forks share the live blocks and the null positions.
    f = req("f", list(a.token_ids))
    kv.fork(a, f)
    kv.check_invariants([a, b, c, f])
    for r in (a, b, c, f):
        kv.free_request(r)
    kv.check_invariants([])
    assert kv.num_free_blocks == kv.num_usable_blocks == 31


def test_hit_needs_every_block_of_its_window():
    """A gap in the cached blocks: the hit ends where a window after it is whole again."""
    kv = KVCacheManager(8, 4, window=6)
    x = object()
    # first needed block for a hit of L blocks: (4L - 5) // 4 -> L=5: 3, L=6: 4, L=7: 5
    assert kv._common_hit([[x, x, None, x, x, x, None]]) == [[None] * 4 + [x, x]]
    assert kv._common_hit([[x, x, None]]) == [[x, x]]
    assert kv._common_hit([[None, x, None, None]]) == [[]]


def test_without_prefix_caching_releases_at_once():
    kv = KVCacheManager(16, 4, enable_prefix_caching=False, window=5)
    a = req("a", list(range(40)))
    advance(kv, a, 16)
    advance(kv, a, 1)  # computed 16 before it: keys >= 12 needed, blocks 0-2 released
    assert a.block_ids[:3] == [kv.null_block] * 3 and kv.num_free_blocks == 15 - 2
    kv.check_invariants([a])
    kv.free_request(a)
    assert kv.num_free_blocks == 15
