"""Paged attention over the block-table KV cache: varlen (prefill / chunked prefill / mixed).

Cache layout per layer: `k_cache`, `v_cache` `[num_blocks, block_size, kv_heads, head_dim]`.
One program handles BLOCK_Q query tokens x all query heads of one KV head (GQA grouping:
row r of the tile is token r // GROUP_PAD, head r % GROUP_PAD), so each K/V tile is read
once per KV head. Keys are gathered through the block table in tiles of BLOCK_N.

The grid is flat: sequence b owns the query tiles from `query_start_loc[b] // BLOCK_Q + b`
on (at least ceil(query_len / BLOCK_Q) of them), so `num_tokens // BLOCK_Q + batch` programs
per KV head cover every sequence, and a program finds its sequence by a binary search. The
grid then depends on the token count and the batch size alone: a mixed step of one long chunk
and many decodes launches no program per (decode, tile of the chunk), and a captured graph's
grid (static token count, static batch padded with empty sequences) covers any step that fits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._attn_common import (
    _dequant_tile,
    _dim_mask,
    _load_kv_tile,
    _softmax_step,
    check_attention_args,
    dot_flags,
    fp8_as_f16,
    head_pad,
    kv_scale_args,
    score_args,
)
from .decode import paged_attention_decode

__all__ = ["paged_attention_decode", "paged_attention_varlen"]


# Per-step ints are not specialised on (a variant per "equal to 1 / divisible by 16" would
# compile while serving); the tile sizes, chosen from max_query_len, are the only variants.
@triton.jit
def _find_sequence(qsl_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """The last sequence b whose first tile `qsl[b] // BLOCK_Q + b` is at most `tile`."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(qsl_ptr + mid) // BLOCK_Q + mid <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit(do_not_specialize=["window", "stride_bt", "num_seqs"])
def _varlen_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    qsl_ptr,
    seq_lens_ptr,
    bt_ptr,
    k_scale_ptr,
    v_scale_ptr,
    qk_scale,
    cap_log2e,
    window,
    num_seqs,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_cb,
    stride_cs,
    stride_ch,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    QUANT: tl.constexpr,
    F16: tl.constexpr,  # an fp8 cache read as fp16 (q cast too): see fp8_as_f16
):
    flat = tl.program_id(0)
    kv_head = tl.program_id(1)
    b = _find_sequence(qsl_ptr, flat, num_seqs, BLOCK_Q)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    q0 = (flat - q_start // BLOCK_Q - b) * BLOCK_Q
    if q0 >= q_len:  # tile past this sequence's queries (or query_len 0)
        return
    seq_len = tl.load(seq_lens_ptr + b)
    ctx = seq_len - q_len  # tokens cached before this step's queries

    r = tl.arange(0, BLOCK_M)
    q_idx = q0 + r // GROUP_PAD
    g = r % GROUP_PAD
    row_ok = (q_idx < q_len) & (g < GROUP)
    head = kv_head * GROUP + g
    tok = (q_start + q_idx).to(tl.int64)
    d = tl.arange(0, HEAD_PAD)
    io_mask = _dim_mask(row_ok, HEAD_DIM, HEAD_PAD)
    q_ptrs = q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptrs, mask=io_mask, other=0.0)
    if F16:
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    q_pos = ctx + q_idx  # absolute position of each row's query token

    v_scale = 1.0
    if QUANT:  # fp8 cache: K's scale folds into the scores, V's into the output
        qk_scale = qk_scale * tl.load(k_scale_ptr + kv_head)
        v_scale = tl.load(v_scale_ptr + kv_head)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    kv_end = tl.minimum(seq_len, ctx + q0 + BLOCK_Q)  # causal: last query of the tile
    # Whole tiles of keys before the tile's first query are visible to every row: no mask.
    full_end = (ctx + q0) // BLOCK_N * BLOCK_N
    kv_lo = 0
    kv_start = 0
    if HAS_WINDOW:  # keys before the first row's window are seen by no row: skip their tiles
        kv_lo = tl.maximum(ctx + q0 - window + 1, 0)
        kv_start = kv_lo // BLOCK_N * BLOCK_N
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    for start in range(kv_start, full_end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        # Never read below the window: the KV cache may have released those blocks (their
        # block-table entries are the null block, or stale).
        k_t, v = _load_kv_tile(
            k_cache_ptr, v_cache_ptr, bt_row, kv_head, pos, (pos < kv_end) & (pos >= kv_lo),
            stride_cb, stride_cs, stride_ch, BLOCK_SIZE, HEAD_DIM, HEAD_PAD,
        )  # fmt: skip
        k_t, v = _dequant_tile(k_t, v, q, QUANT, UPCAST)
        mask = None
        if HAS_WINDOW:  # HF: key j visible to query i when j > i - window
            mask = pos[None, :] > q_pos[:, None] - window
        acc, m_i, l_i = _softmax_step(
            q, k_t, v, acc, m_i, l_i, mask, qk_scale, IEEE, UPCAST, MASK=HAS_WINDOW,
            SOFTCAP=SOFTCAP, cap_log2e=cap_log2e,
        )  # fmt: skip
    for start in range(full_end, kv_end, BLOCK_N):  # the causal diagonal
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < kv_end
        k_t, v = _load_kv_tile(  # a window narrower than a tile: not below it either
            k_cache_ptr, v_cache_ptr, bt_row, kv_head, pos, valid & (pos >= kv_lo),
            stride_cb, stride_cs, stride_ch, BLOCK_SIZE, HEAD_DIM, HEAD_PAD,
        )  # fmt: skip
        k_t, v = _dequant_tile(k_t, v, q, QUANT, UPCAST)
        mask = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            mask = mask & (pos[None, :] > q_pos[:, None] - window)
        acc, m_i, l_i = _softmax_step(
            q, k_t, v, acc, m_i, l_i, mask, qk_scale, IEEE, UPCAST,
            SOFTCAP=SOFTCAP, cap_log2e=cap_log2e,
        )  # fmt: skip

    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    if QUANT:
        acc = acc * v_scale
    o = acc / l_i[:, None]
    o_ptrs = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=io_mask)


def paged_attention_varlen(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
    window: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    f16: bool | None = None,
) -> torch.Tensor:
    """Causal attention for a flat batch of variable-length query chunks; writes `out`.
    `window`: each query sees the keys at positions > its own - window (HF's sliding
    window); `softcap`: scores become softcap * tanh(scores / softcap) (Gemma 2). An fp8
    cache is read as stored * scale, float32 `k_scale`/`v_scale` `[kv_heads]` (None: 1.0).

    q/out `[T, num_heads, head_dim]`; query_start_loc int32 `[B+1]`; seq_lens int32 `[B]`
    (context length including this step's queries, whose K/V are already cached);
    block_tables int32 `[B, max_blocks]`. `max_query_len` (at least the longest chunk)
    picks the tiles; the grid comes from T and B (no host sync). Sequences may be empty (a
    graph's padding), and rows past `query_start_loc[B]` are left unwritten.
    """
    group = check_attention_args(q, k_cache, v_cache)
    assert out.shape == q.shape and out.stride(-1) == 1
    batch = seq_lens.shape[0]
    if batch == 0 or max_query_len <= 0:
        return out
    block_size, head_dim = k_cache.shape[1], k_cache.shape[3]
    group_pad = triton.next_power_of_2(group)
    pad = head_pad(head_dim)  # tiles are powers of two: other head sizes are masked
    # Tuned on an H200 (bf16, D=128): BLOCK_M 64 x BLOCK_N 64, 4 warps, 2 stages.
    # Platforms with less shared memory (ROCm) pass smaller tiles; these are the defaults.
    cap = block_m or 64
    block_m = max(16, group_pad, min(cap, triton.next_power_of_2(max_query_len) * group_pad))
    block_q = block_m // group_pad
    block_n = block_n or min(64, 16384 // (pad * q.element_size()))  # K+V tile <= 32 KiB
    num_warps = num_warps or (4 if pad <= 128 else 8)
    grid = (q.shape[0] // block_q + batch, k_cache.shape[2])
    sargs = score_args(scale, window, softcap)
    k_scale, v_scale, quant = kv_scale_args(k_cache, k_scale, v_scale, k_cache.shape[2])
    _varlen_kernel[grid](
        q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables,
        k_scale if quant else seq_lens, v_scale if quant else seq_lens,  # unread unless QUANT
        sargs["qk_scale"], sargs["cap_log2e"], sargs["window"], batch,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, HEAD_PAD=pad, **dot_flags(q),
        HAS_WINDOW=sargs["HAS_WINDOW"], SOFTCAP=sargs["SOFTCAP"], QUANT=quant,
        F16=fp8_as_f16(q, quant) if f16 is None else f16,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out
