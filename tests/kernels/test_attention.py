"""Paged attention kernels against a float64 gather-and-softmax reference."""

import pytest
import torch

from paged.kernels import (
    decode_workspace,
    paged_attention_decode,
    paged_attention_varlen,
    reshape_and_cache,
)

TOL = {torch.float32: 2e-4, torch.bfloat16: 2e-2}


def make_cache(seq_lens, kv_heads, head_dim, block_size, dtype, gen, device):
    """Random cache `[2, num_blocks, bs, kv_heads, D]` and a permuted block table."""
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    width = max(max(blocks_per_seq), 1)
    num_blocks = sum(blocks_per_seq) + 3
    kv = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.full((len(seq_lens), width), num_blocks - 1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks_per_seq):
        table[b, :n] = perm[used : used + n]
        used += n
    return kv.to(device), table.to(device)


def reference(q, k_cache, v_cache, query_lens, seq_lens, table, scale):
    """Float64 causal attention per sequence, K/V gathered through the block table."""
    q, k_cache, v_cache, table = q.cpu(), k_cache.cpu(), v_cache.cpu(), table.cpu()
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64)
    start = 0
    for b, (ql, sl) in enumerate(zip(query_lens, seq_lens, strict=True)):
        if ql == 0:
            continue
        blocks = table[b, : -(-sl // block_size)].long()
        k = k_cache[blocks].reshape(-1, kv_heads, k_cache.shape[3])[:sl].double()
        v = v_cache[blocks].reshape(-1, kv_heads, v_cache.shape[3])[:sl].double()
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        qb = q[start : start + ql].double()
        s = torch.einsum("qhd,khd->hqk", qb, k) * scale
        q_pos = sl - ql + torch.arange(ql)
        s = s.masked_fill(torch.arange(sl)[None, :] > q_pos[:, None], float("-inf"))
        out[start : start + ql] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
        start += ql
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.cpu().double() - b).norm() / b.norm().clamp_min(1e-12)).item()


def strided_q(tokens, heads, kv_heads, head_dim, dtype, gen, device):
    """q as a slice of a fused qkv projection output (non-contiguous rows)."""
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen)
    qkv = qkv.to(device, dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    assert not q.is_contiguous()
    return q


CASES = {
    "prefill": ([1, 15, 16, 17, 33], None),
    "chunked": ([33, 70, 17, 5, 9], [16, 3, 17, 1, 0]),  # earlier chunks already cached
    "long": ([130, 2], [130, 1]),  # several key tiles and query tiles
}


def i32(values, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_varlen(heads, kv_heads, dtype, case, device):
    gen = torch.Generator().manual_seed(hash((heads, case, str(dtype))) % 2**31)
    head_dim, block_size = 64, 16
    seq_lens, query_lens = CASES[case]
    query_lens = query_lens or seq_lens
    kv, table = make_cache(seq_lens, kv_heads, head_dim, block_size, dtype, gen, device)
    q = strided_q(sum(query_lens), heads, kv_heads, head_dim, dtype, gen, device)
    out = torch.full(q.shape, float("nan"), dtype=dtype, device=device)
    qsl = i32([0, *torch.tensor(query_lens).cumsum(0).tolist()], device)
    scale = head_dim**-0.5
    paged_attention_varlen(
        q, kv[0], kv[1], out, qsl, i32(seq_lens, device), table, scale,
        max(query_lens), max(seq_lens),
    )  # fmt: skip
    ref = reference(q, kv[0], kv[1], query_lens, seq_lens, table, scale)
    assert not out.isnan().any(), "every query row must be written"
    assert rel_err(out, ref) < TOL[dtype]


def test_varlen_padded_like_a_graph(device):
    """A captured step's view: more token rows than the batch's (unwritten), empty sequences
    after the real ones, max_query_len the static token count; the real rows match the
    reference, and a decode row among long chunks is covered by the flat grid."""
    gen = torch.Generator().manual_seed(11)
    heads, kv_heads, head_dim, block_size, dtype = 8, 2, 64, 16, torch.float32
    seq_lens, query_lens = [40, 1, 70, 9], [33, 1, 70, 0]  # a chunk, a decode, a prompt, none
    real = sum(query_lens)
    kv, table = make_cache(seq_lens + [0, 0, 0], kv_heads, head_dim, block_size, dtype, gen,
                           device)  # fmt: skip
    rows = 160  # the static token count
    q = strided_q(rows, heads, kv_heads, head_dim, dtype, gen, device)
    out = torch.full(q.shape, float("nan"), dtype=dtype, device=device)
    ends = torch.tensor(query_lens).cumsum(0).tolist()
    qsl = i32([0, *ends, real, real, real], device)  # three empty padding sequences
    seq = i32(seq_lens + [0, 0, 0], device)
    paged_attention_varlen(q, kv[0], kv[1], out, qsl, seq, table, 0.125, rows, 512)
    ref = reference(q[:real], kv[0], kv[1], query_lens, seq_lens, table[:4], 0.125)
    assert not out[:real].isnan().any(), "every real query row must be written"
    assert out[real:].isnan().all(), "padding rows are left alone"
    assert rel_err(out[:real], ref) < TOL[dtype]


@pytest.mark.parametrize("head_dim,block_size", [(128, 16), (256, 16), (32, 8), (16, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_shapes(head_dim, block_size, dtype, device):
    gen = torch.Generator().manual_seed(head_dim)
    seq_lens, query_lens = [17, 40], [17, 7]
    kv, table = make_cache(seq_lens, 1, head_dim, block_size, dtype, gen, device)
    q = torch.randn(sum(query_lens), 3, head_dim, generator=gen).to(device, dtype)  # group 3
    out = torch.empty_like(q)
    qsl, seq = i32([0, 17, 24], device), i32(seq_lens, device)
    paged_attention_varlen(q, kv[0], kv[1], out, qsl, seq, table, 0.3, 17, 40)
    ref = reference(q, kv[0], kv[1], query_lens, seq_lens, table, 0.3)
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3, None])
def test_decode(heads, kv_heads, dtype, num_splits, device):
    gen = torch.Generator().manual_seed(hash((heads, num_splits, str(dtype))) % 2**31)
    head_dim, block_size = 64, 16
    seq_lens = [1, 15, 16, 17, 33, 150]
    kv, table = make_cache(seq_lens, kv_heads, head_dim, block_size, dtype, gen, device)
    q = strided_q(len(seq_lens), heads, kv_heads, head_dim, dtype, gen, device)
    out = torch.full(q.shape, float("nan"), dtype=dtype, device=device)
    seq, scale = i32(seq_lens, device), head_dim**-0.5
    paged_attention_decode(q, kv[0], kv[1], out, seq, table, scale, max(seq_lens), num_splits)
    ref = reference(q, kv[0], kv[1], [1] * len(seq_lens), seq_lens, table, scale)
    assert not out.isnan().any()
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [128, 256])
def test_decode_head_dims(dtype, head_dim, device):
    gen = torch.Generator().manual_seed(head_dim)
    seq_lens = [40, 300]
    kv, table = make_cache(seq_lens, 2, head_dim, 16, dtype, gen, device)
    q = torch.randn(2, 4, head_dim, generator=gen).to(device, dtype)
    out = torch.empty_like(q)
    paged_attention_decode(q, kv[0], kv[1], out, i32(seq_lens, device), table, 0.1, 300, 2)
    ref = reference(q, kv[0], kv[1], [1, 1], seq_lens, table, 0.1)
    assert rel_err(out, ref) < TOL[dtype]


def test_decode_workspace_and_padding(device):
    """Preallocated oversized workspace (CUDA-graph style) and seq_len 0 padding rows."""
    gen = torch.Generator().manual_seed(7)
    heads, kv_heads, head_dim = 8, 2, 32
    seq_lens = [64, 0, 5, 0]
    kv, table = make_cache(seq_lens, kv_heads, head_dim, 16, torch.float32, gen, device)
    q = torch.randn(len(seq_lens), heads, head_dim, generator=gen).to(device)
    ws = decode_workspace(8, heads, head_dim, 8, device=device)
    out = torch.full_like(q, float("nan"))
    seq = i32(seq_lens, device)
    paged_attention_decode(q, kv[0], kv[1], out, seq, table, 0.2, 64, num_splits=4, workspace=ws)
    ref = reference(q, kv[0], kv[1], [1] * 4, seq_lens, table, 0.2)
    assert not out[[1, 3]].any()
    assert rel_err(out, ref) < TOL[torch.float32]


def test_write_then_attend(device):
    """reshape_and_cache -> varlen prefill -> decode step, all through the same cache."""
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, head_dim, block_size = 4, 2, 32, 16
    prompt = [20, 9]
    kv, table = make_cache([21, 10], kv_heads, head_dim, block_size, torch.float32, gen, device)
    kv.fill_(float("nan"))  # unwritten slots must never be read

    def slots(b: int, positions: range) -> list[int]:
        return [int(table[b, p // block_size]) * block_size + p % block_size for p in positions]

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device)

    k, v = randn(sum(prompt), kv_heads, head_dim), randn(sum(prompt), kv_heads, head_dim)
    slot = torch.tensor(slots(0, range(20)) + slots(1, range(9)), device=device)
    reshape_and_cache(k, v, kv[0], kv[1], slot)
    q = randn(sum(prompt), heads, head_dim)
    out = torch.empty_like(q)
    qsl, seq = i32([0, 20, 29], device), i32(prompt, device)
    paged_attention_varlen(q, kv[0], kv[1], out, qsl, seq, table, 0.25, 20, 20)
    assert rel_err(out, reference(q, kv[0], kv[1], prompt, prompt, table, 0.25)) < 2e-4

    k1, v1 = randn(2, kv_heads, head_dim), randn(2, kv_heads, head_dim)
    slot1 = torch.tensor(slots(0, range(20, 21)) + [-1], device=device)
    reshape_and_cache(k1, v1, kv[0], kv[1], slot1)
    q1 = randn(1, heads, head_dim)
    out1 = torch.empty_like(q1)
    seq1 = i32([21], device)
    paged_attention_decode(q1, kv[0], kv[1], out1, seq1, table[:1], 0.25, 21, num_splits=2)
    assert rel_err(out1, reference(q1, kv[0], kv[1], [1], [21], table, 0.25)) < 2e-4


def test_decode_cuda_graph_replay(device):
    """Captured once, replayed with new seq_lens/tables/q: the grid must not bake them in."""
    if device != "cuda":
        pytest.skip("needs a CUDA device")
    gen = torch.Generator().manual_seed(11)
    heads, kv_heads, head_dim, batch = 8, 2, 64, 4
    kv, table = make_cache([300] * batch, kv_heads, head_dim, 16, torch.bfloat16, gen, device)
    q = torch.randn(batch, heads, head_dim, generator=gen).to(device, torch.bfloat16)
    seq, out = i32([1] * batch, device), torch.empty_like(q)
    ws = decode_workspace(batch, heads, head_dim, 4, device=device)
    run = lambda: paged_attention_decode(q, kv[0], kv[1], out, seq, table, 0.1, 300, 4, ws)
    run()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for lens in ([300, 17, 1, 160], [5, 299, 64, 0]):
        seq.copy_(i32(lens, device))
        q.copy_(torch.randn(batch, heads, head_dim, generator=gen))
        table.copy_(table[torch.randperm(batch, generator=gen).to(device)])
        graph.replay()
        ref = reference(q, kv[0], kv[1], [1] * batch, lens, table, 0.1)
        assert rel_err(out, ref) < TOL[torch.bfloat16]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_smaller_tiles(dtype, device):
    """The tile arguments a platform with less shared memory passes (ROCm): same results."""
    gen = torch.Generator().manual_seed(11)
    head_dim, block_size, heads, kv_heads = 128, 16, 8, 2
    seq_lens, query_lens = [17, 70, 33], [17, 9, 1]
    kv, table = make_cache(seq_lens, kv_heads, head_dim, block_size, dtype, gen, device)
    scale = head_dim**-0.5
    q = strided_q(sum(query_lens), heads, kv_heads, head_dim, dtype, gen, device)
    out = torch.full(q.shape, float("nan"), dtype=dtype, device=device)
    qsl = i32([0, 17, 26, 27], device)
    paged_attention_varlen(
        q, kv[0], kv[1], out, qsl, i32(seq_lens, device), table, scale, 17, 70,
        block_m=32, block_n=32, num_warps=4, num_stages=2,
    )  # fmt: skip
    ref = reference(q, kv[0], kv[1], query_lens, seq_lens, table, scale)
    assert rel_err(out, ref) < TOL[dtype]
    qd = strided_q(len(seq_lens), heads, kv_heads, head_dim, dtype, gen, device)
    outd = torch.full(qd.shape, float("nan"), dtype=dtype, device=device)
    paged_attention_decode(
        qd, kv[0], kv[1], outd, i32(seq_lens, device), table, scale, 70, 2,
        block_n=32, num_warps=4, num_stages=2,
    )  # fmt: skip
    refd = reference(qd, kv[0], kv[1], [1] * 3, seq_lens, table, scale)
    assert not outd.isnan().any()
    assert rel_err(outd, refd) < TOL[dtype]


def test_varlen_rows_padded_as_verification_graphs_pad_them(device):
    """The layout of speculative decoding's verification graphs (worker/graph_runner.py):
    each request's rows padded to Q after its real ones, its length grown by the padding
    (so its context, length - Q, is unchanged) and the padding's keys read from wherever the
    table points; the real rows' outputs equal the unpadded batch's."""
    gen = torch.Generator().manual_seed(7)
    heads, kv_heads, d, bs, q_width = 8, 2, 64, 16, 4
    qlens, slens = [1, 4, 2, 3], [40, 17, 33, 5]
    kv, table = make_cache([s + q_width for s in slens], kv_heads, d, bs, torch.float32, gen,
                           device)  # fmt: skip
    q = torch.randn(sum(qlens), heads, d, generator=gen).to(device)
    qsl = i32([0, *torch.tensor(qlens).cumsum(0).tolist()], device)
    ref = torch.zeros_like(q)
    paged_attention_varlen(q, kv[0], kv[1], ref, qsl, i32(slens, device), table, 0.125,
                           max(qlens), max(slens))  # fmt: skip
    rows = torch.tensor([i * q_width + j for i, n in enumerate(qlens) for j in range(n)])
    padded_q = torch.randn(len(qlens) * q_width, heads, d, generator=gen).to(device)
    padded_q[rows.to(device)] = q
    out = torch.zeros_like(padded_q)
    padded_lens = i32([s + q_width - n for s, n in zip(slens, qlens)], device)
    padded_qsl = torch.arange(0, len(qlens) * q_width + 1, q_width, dtype=torch.int32,
                              device=device)  # fmt: skip
    paged_attention_varlen(padded_q, kv[0], kv[1], out, padded_qsl, padded_lens, table, 0.125,
                           q_width, max(slens) + q_width)  # fmt: skip
    torch.testing.assert_close(out[rows.to(device)], ref, rtol=1e-5, atol=1e-5)
