"""The one-launch decode (interpreter, tiny shapes): the split kernel writes the step's K/V to
the cache (as reshape_and_cache: bit-exact, fp8 included) before it reads it, and the last
split of each (sequence, KV head) merges the splits; against a torch write and the float64
reference, the counters left zero."""

import pytest
import torch
from test_attention import TOL, i32, make_cache, rel_err
from test_kv_fp8 import FP8, fp8_cache
from test_window_softcap import reference

from paged.kernels import decode_workspace, paged_attention_decode
from paged.kernels.decode import decode_counters
from paged.model.kv_quant import dequantize, quantize

# Block n 16, four splits: 150's newest in the last split, 33's in split 2 and 17's in split 1
# (the later splits empty), 5's and 1's in split 0; a padding row (seq_len 0, slot -1).
SEQ_LENS = [5, 150, 33, 0, 17, 1]
BLOCK_N = 16


def newest_split(seq_len: int, splits: int, block_n: int) -> int:
    """The split of the kernel's partition (no window) that holds position seq_len - 1."""
    per_split = -(-seq_len // splits)
    return (seq_len - 1) // (-(-per_split // block_n) * block_n)


def test_cases_reach_a_middle_split():
    splits = [newest_split(s, 4, BLOCK_N) for s in SEQ_LENS if s]
    assert splits == [0, 3, 2, 1, 0]


def newest_slots(table, seq_lens, block_size, padding=()) -> torch.Tensor:
    """Each sequence's slot of position seq_len - 1 (-1 for padding rows)."""
    slots = [-1 if b in padding or n == 0 else
             int(table[b, (n - 1) // block_size]) * block_size + (n - 1) % block_size
             for b, n in enumerate(seq_lens)]  # fmt: skip
    return torch.tensor(slots, dtype=torch.long, device=table.device)


def qkv(batch, heads, kv_heads, head_dim, dtype, gen, device, mag=1.0):
    """q, k, v as views of one fused projection output (strided rows, as the model has)."""
    x = torch.randn(batch, (heads + 2 * kv_heads) * head_dim, generator=gen) * mag
    x = x.to(device, dtype)
    q, k, v = x.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    view = lambda t, h: t.view(batch, h, head_dim)  # noqa: E731
    return view(q, heads), view(k, kv_heads), view(v, kv_heads)


def poison(cache: torch.Tensor, slots: torch.Tensor) -> None:
    """NaN at the slots the kernel writes: reading one before the write shows in the output."""
    flat = cache.view(2, -1, *cache.shape[3:])
    ok = slots[slots >= 0]
    if cache.dtype in FP8:
        flat.view(torch.uint8)[:, ok] = 0x7F  # NaN in e4m3fn and e5m2
    else:
        flat[:, ok] = float("nan")


def torch_write(cache, k, v, slots, scales=None) -> torch.Tensor:
    """The cache after reshape_and_cache's write, in torch."""
    want = cache.clone()
    flat = want.view(2, -1, *cache.shape[3:])
    ok = slots >= 0
    for i, x in enumerate((k, v)):
        x = x[ok]
        if scales is not None:
            x = quantize(x.float(), scales[i], cache.dtype)
        flat[i, slots[ok]] = x.to(cache.dtype)
    return want


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype in FP8:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(a, b)


def run_fused(q, k, v, kv, table, seq_lens, slots, splits, counters=None, workspace=None,
              **kw) -> torch.Tensor:  # fmt: skip
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
    paged_attention_decode(q, kv[0], kv[1], out, i32(seq_lens, q.device), table, 0.3,
                           max(seq_lens), splits, workspace, block_n=BLOCK_N, counters=counters,
                           key=k, value=v, slot_mapping=slots, **kw)  # fmt: skip
    return out


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (3, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_fused_write_and_merge(heads, kv_heads, dtype, num_splits, device):
    gen = torch.Generator().manual_seed(hash((heads, str(dtype), num_splits)) % 2**31)
    head_dim, block_size = 32, 8
    kv, table = make_cache(SEQ_LENS, kv_heads, head_dim, block_size, dtype, gen, device)
    q, k, v = qkv(len(SEQ_LENS), heads, kv_heads, head_dim, dtype, gen, device)
    slots = newest_slots(table, SEQ_LENS, block_size)
    want = torch_write(kv, k, v, slots)
    poison(kv, slots)
    counters = decode_counters(len(SEQ_LENS), kv_heads, device) if num_splits > 1 else None
    out = run_fused(q, k, v, kv, table, SEQ_LENS, slots, num_splits, counters)
    assert same_bits(kv, want)  # the newest K/V written, nothing else touched
    assert not out.isnan().any()
    assert not out[SEQ_LENS.index(0)].any()  # the padding row: zeros
    ref = reference(q, want, [1] * len(SEQ_LENS), SEQ_LENS, table, 0.3)
    assert rel_err(out, ref) < TOL[dtype]
    if counters is not None:
        assert not counters.any()
        # merged by a second launch instead (no counters): the same arithmetic, the same bits
        kv2 = kv.clone()
        poison(kv2, slots)
        assert torch.equal(run_fused(q, k, v, kv2, table, SEQ_LENS, slots, num_splits), out)
        assert same_bits(kv2, want)


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_fused_write_fp8(fp8, dtype, num_splits, device):
    """The fp8 cache: stored as torch's quantize (subnormals, rounding carries, saturation),
    read back dequantized."""
    gen = torch.Generator().manual_seed(num_splits + 10 * FP8.index(fp8))
    heads, kv_heads, head_dim, block_size = 8, 2, 24, 8  # 24: masked head dims
    kv, scales, _, table = fp8_cache(SEQ_LENS, kv_heads, head_dim, block_size, fp8, gen,
                                     device)  # fmt: skip
    q, k, v = qkv(len(SEQ_LENS), heads, kv_heads, head_dim, dtype, gen, device)
    k = k * torch.logspace(-4, 3, head_dim).to(device, dtype)  # every magnitude, per dim
    slots = newest_slots(table, SEQ_LENS, block_size)
    want = torch_write(kv, k, v, slots, scales)
    poison(kv, slots)
    out = run_fused(q, k, v, kv, table, SEQ_LENS, slots, num_splits, k_scale=scales[0],
                    v_scale=scales[1])  # fmt: skip
    assert same_bits(kv, want)
    deq = torch.stack([dequantize(want[i], scales[i], torch.float32) for i in (0, 1)])
    ref = reference(q, deq, [1] * len(SEQ_LENS), SEQ_LENS, table, 0.3)
    assert not out.isnan().any()
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("window,softcap", [(20, None), (7, 2.0), (1, None)])
def test_fused_window_softcap(window, softcap, device):
    """A window: the split partition starts at seq_len - window; the newest is still written
    by the split that holds it."""
    gen = torch.Generator().manual_seed(window)
    heads, kv_heads, head_dim, block_size = 4, 2, 32, 8
    kv, table = make_cache(SEQ_LENS, kv_heads, head_dim, block_size, torch.float32, gen, device)
    q, k, v = qkv(len(SEQ_LENS), heads, kv_heads, head_dim, torch.float32, gen, device)
    slots = newest_slots(table, SEQ_LENS, block_size)
    want = torch_write(kv, k, v, slots)
    poison(kv, slots)
    out = run_fused(q, k, v, kv, table, SEQ_LENS, slots, 3, window=window, softcap=softcap)
    assert same_bits(kv, want)
    ref = reference(q, want, [1] * len(SEQ_LENS), SEQ_LENS, table, 0.3, window, softcap)
    assert not out.isnan().any()
    assert rel_err(out, ref) < TOL[torch.float32]


def test_counters_and_workspace_shared_by_launches(device):
    """Two layers' launches (different splits) through one oversized workspace and counter
    buffer, as the backend and its graphs use them: each correct, the counters zero after
    each; a row with a slot of -1 but a context (a graph's stale row) writes nothing."""
    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, head_dim, block_size = 8, 2, 32, 8
    ws = decode_workspace(16, heads, head_dim, 8, device=device)
    counters = decode_counters(16, kv_heads, device)
    for splits in (4, 2, 7):
        kv, table = make_cache(SEQ_LENS, kv_heads, head_dim, block_size, torch.float32, gen,
                               device)  # fmt: skip
        q, k, v = qkv(len(SEQ_LENS), heads, kv_heads, head_dim, torch.float32, gen, device)
        slots = newest_slots(table, SEQ_LENS, block_size, padding=(2,))
        want = torch_write(kv, k, v, slots)
        out = run_fused(q, k, v, kv, table, SEQ_LENS, slots, splits, counters, ws)
        assert same_bits(kv, want) and not counters.any()
        ref = reference(q, want, [1] * len(SEQ_LENS), SEQ_LENS, table, 0.3)
        assert rel_err(out, ref) < TOL[torch.float32]


@pytest.mark.parametrize("ticket", [False, True])
def test_splits_past_the_context_are_neither_written_nor_read(ticket, device):
    """32 splits (a graph's) over contexts of one to four tiles: the splits past a context
    stop, a one-split context is written by its program, and the merge (second launch or
    ticket) reads only the splits that hold keys: a NaN workspace stays NaN past them and
    the output is right."""
    from paged.kernels.decode import MAX_SPLITS

    gen = torch.Generator().manual_seed(2)
    heads, kv_heads, head_dim, block_size = 4, 2, 32, 8
    seq_lens = [5, 16, 17, 64, 0]  # BLOCK_N 16 and 32 splits: 1, 1, 2, 4 and 1 split(s)
    kv, table = make_cache(seq_lens, kv_heads, head_dim, block_size, torch.float32, gen,
                           device)  # fmt: skip
    q, k, v = qkv(len(seq_lens), heads, kv_heads, head_dim, torch.float32, gen, device)
    slots = newest_slots(table, seq_lens, block_size)
    want = torch_write(kv, k, v, slots)
    ws = decode_workspace(len(seq_lens), heads, head_dim, MAX_SPLITS, device).fill_(float("nan"))
    counters = decode_counters(len(seq_lens), kv_heads, device) if ticket else None
    out = run_fused(q, k, v, kv, table, seq_lens, slots, MAX_SPLITS, counters, ws)
    ref = reference(q, want, [1] * len(seq_lens), seq_lens, table, 0.3)
    assert not out.isnan().any() and rel_err(out, ref) < TOL[torch.float32]
    assert not out[seq_lens.index(0)].any()
    for b, n in enumerate(seq_lens):
        used = max(-(-n // BLOCK_N), 1)
        assert ws[b, :, used:].isnan().all()  # never written
        assert used == 1 or not ws[b, :, :used].isnan().any()


def test_backend_decode_step_writes_the_cache(device, monkeypatch):
    """TritonAttentionBackend.forward on a decode-only step: with fuse_decode the decode
    kernel writes K/V (no reshape_and_cache), without it the cache write runs first; its
    splits merge in a second launch, or with merge_in_split in the split kernel (a ticket).
    The same bits every way."""
    from paged import kernels
    from paged.kernels import decode
    from paged.kernels.backend import TritonAttentionBackend
    from paged.model.attention import AttentionMetadata

    launched = []
    for mod, name in ((kernels, "reshape_and_cache"), (decode, "_reduce_kernel")):
        monkeypatch.setattr(mod, name, _Spy(getattr(mod, name), launched, name))
    heads, kv_heads, head_dim, block_size = 8, 2, 32, 8
    seq_lens = [150, 33, 17]
    n = len(seq_lens)
    outs, caches = [], []
    for fuse, in_split in ((True, False), (False, False), (True, True)):
        monkeypatch.setattr(TritonAttentionBackend, "fuse_decode", fuse)
        monkeypatch.setattr(TritonAttentionBackend, "merge_in_split", in_split)
        gen = torch.Generator().manual_seed(2)
        backend = TritonAttentionBackend(heads, kv_heads, head_dim, 0.3, block_size,
                                         torch.float32, torch.device(device))  # fmt: skip
        kv, table = make_cache(seq_lens, kv_heads, head_dim, block_size, torch.float32, gen,
                               device)  # fmt: skip
        q, k, v = qkv(n, heads, kv_heads, head_dim, torch.float32, gen, device)
        slots = newest_slots(table, seq_lens, block_size)
        want = torch_write(kv, k, v, slots)
        poison(kv, slots)
        meta = AttentionMetadata(
            num_reqs=n, num_decodes=n, num_tokens=n,
            query_start_loc=i32(list(range(n + 1)), device), seq_lens=i32(seq_lens, device),
            block_tables=table, slot_mapping=slots, max_query_len=1, max_seq_len=max(seq_lens),
        )  # fmt: skip
        meta = backend.plan(meta, num_splits=4)
        if in_split:  # the tickets exist only for the merge in the split kernel
            assert backend.counters.numel() >= n * kv_heads
        else:
            assert backend.counters is None
        launched.clear()
        outs.append(backend.forward(q, k, v, kv, meta))
        caches.append(kv)
        assert same_bits(kv, want) and (not in_split or not backend.counters.any())
        want_launched = ([] if fuse else ["reshape_and_cache"]) + ([] if in_split else
                                                                   ["_reduce_kernel"])  # fmt: skip
        assert launched == want_launched
        ref = reference(q, want, [1] * n, seq_lens, table, 0.3)
        assert rel_err(outs[-1], ref) < TOL[torch.float32]
    for out, kv in zip(outs[1:], caches[1:]):
        assert torch.equal(outs[0], out) and same_bits(caches[0], kv)


class _Spy:
    """A kernel or function that records its name when launched or called."""

    def __init__(self, real, log: list, name: str) -> None:
        self.real, self.log, self.name = real, log, name

    def __getitem__(self, grid):  # a Triton kernel's launch
        self.log.append(self.name)
        return self.real[grid]

    def __call__(self, *args, **kwargs):
        self.log.append(self.name)
        return self.real(*args, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("fp8", [None, torch.float8_e4m3fn])
def test_rotary_inside_the_decode(dtype, num_splits, fp8, device):
    """q and the newest key rotated inside the kernel: the same cache bits and output as the
    rotary kernel first (q and k rotated in memory), then the one-launch decode; q is left
    as it was."""
    from transformers import LlamaConfig

    from paged.kernels import rotary_embedding
    from paged.model.llama import rope_cache

    gen = torch.Generator().manual_seed(num_splits + (fp8 is not None))
    heads, kv_heads, head_dim, block_size = 8, 2, 32, 8
    if fp8 is None:
        kv, table = make_cache(SEQ_LENS, kv_heads, head_dim, block_size, dtype, gen, device)
        scales = {}
    else:
        kv, sc, _, table = fp8_cache(SEQ_LENS, kv_heads, head_dim, block_size, fp8, gen,
                                     device)  # fmt: skip
        scales = {"k_scale": sc[0], "v_scale": sc[1]}
    q, k, v = qkv(len(SEQ_LENS), heads, kv_heads, head_dim, dtype, gen, device)
    cfg = LlamaConfig(hidden_size=heads * head_dim, num_attention_heads=heads, rope_theta=500.0)
    cos_sin = rope_cache(cfg, 256).to(device)
    positions = torch.tensor([max(n - 1, 0) for n in SEQ_LENS], device=device)
    slots = newest_slots(table, SEQ_LENS, block_size)
    q0, k0, kv0 = q.clone(), k.clone(), kv.clone()
    fused = run_fused(q, k, v, kv, table, SEQ_LENS, slots, num_splits,
                      rotary=(positions, cos_sin), **scales)  # fmt: skip
    assert torch.equal(q, q0) and torch.equal(k, k0)  # rotated in registers only
    rq, rk = rotary_embedding(positions, q0.clone(), k0.clone(), cos_sin, head_dim)
    want = run_fused(rq, rk, v, kv0, table, SEQ_LENS, slots, num_splits, **scales)
    assert same_bits(kv, kv0) and torch.equal(fused, want)


def test_backend_rotates_inside_decode_steps(device, monkeypatch):
    """forward_rotary with the Triton op table under fuse_decode: a decode-only step runs no
    rotary kernel and equals the default (the rotary op, then forward)."""
    from transformers import LlamaConfig

    from paged import kernels
    from paged.kernels.backend import TritonAttentionBackend
    from paged.kernels.ops import triton_fused_ops
    from paged.model import ops
    from paged.model.attention import AttentionMetadata
    from paged.model.llama import rope_cache

    monkeypatch.setattr(TritonAttentionBackend, "fuse_decode", True)
    gen = torch.Generator().manual_seed(4)
    heads, kv_heads, head_dim, block_size = 8, 2, 32, 8
    seq_lens = [150, 33, 17]
    n = len(seq_lens)
    cfg = LlamaConfig(hidden_size=heads * head_dim, num_attention_heads=heads)
    table_ops = triton_fused_ops()
    rope = table_ops["rotary_prepare"](torch.tensor([s - 1 for s in seq_lens], device=device),
                                       rope_cache(cfg, 256).to(device), torch.float32)  # fmt: skip
    calls = []
    real = kernels.rotary_embedding
    monkeypatch.setattr(kernels, "rotary_embedding", lambda *a, **kw: calls.append(1)
                        or real(*a, **kw))  # fmt: skip
    with ops.using(table_ops):
        outs, caches = [], []
        for fused in (True, False):
            backend = TritonAttentionBackend(heads, kv_heads, head_dim, 0.3, block_size,
                                             torch.float32, torch.device(device))  # fmt: skip
            g = torch.Generator().manual_seed(5)
            kv, table = make_cache(seq_lens, kv_heads, head_dim, block_size, torch.float32, g,
                                   device)  # fmt: skip
            q, k, v = qkv(n, heads, kv_heads, head_dim, torch.float32, gen.manual_seed(6),
                          device)  # fmt: skip
            meta = AttentionMetadata(
                num_reqs=n, num_decodes=n, num_tokens=n,
                query_start_loc=i32(list(range(n + 1)), device), seq_lens=i32(seq_lens, device),
                block_tables=table, slot_mapping=newest_slots(table, seq_lens, block_size),
                max_query_len=1, max_seq_len=max(seq_lens),
            )  # fmt: skip
            meta = backend.plan(meta, num_splits=4)
            if fused:
                outs.append(backend.forward_rotary(rope[0], q, k, v, kv, meta, rope))
            else:  # the base class's default: the rotary op, then forward
                outs.append(super(TritonAttentionBackend, backend).forward_rotary(
                    rope[0], q, k, v, kv, meta, rope))  # fmt: skip
            caches.append(kv)
    assert calls == [1]  # the default path's only
    assert torch.equal(outs[0], outs[1]) and torch.equal(caches[0], caches[1])
