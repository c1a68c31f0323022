"""Split-K ("flash-decoding") paged attention for one query token per sequence.

Grid `(B, kv_heads, num_splits)`: each program takes the query heads of one KV head (padded
to >= 16 rows for tl.dot) and one contiguous slice of the context, read through the block
table. With num_splits == 1 it writes `out` directly. Otherwise it writes a partial (acc, max,
sum) to a fp32 workspace, merged one of two ways: given `counters`, each split that holds
keys takes a ticket from an int32 counter per (sequence, KV head) and the one that takes the
last merges them in index order (the same result whichever program finishes last), writes
`out` and resets the counter to 0 for the next launch; without, `_reduce_kernel` (a second
launch, one program per (sequence, KV head)) merges them, in the same order and arithmetic
(`_merge`). Splits past the context stop at once (a graph launches MAX_SPLITS whatever the
length), and a context in one split is written by its program directly (what merging it
would write).

Given this step's `key`/`value`, the program whose split holds the newest position also
writes that token to the cache first (`reshape_and_cache` fused in). Launch grids depend only
on shapes and num_splits, and seq_lens is read on the device, so it is CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged.kernels import pdl

from ._attn_common import (
    _dequant_tile,
    _dim_mask,
    _load_kv_tile,
    _softmax_step,
    _store_kv,
    check_attention_args,
    dot_flags,
    fp8_args,
    fp8_as_f16,
    head_pad,
    kv_scale_args,
    score_args,
)

MAX_SPLITS = 32
_SPLITS = tl.constexpr(MAX_SPLITS)
_UNROLL = tl.constexpr(4)  # splits merged a step: their partials' loads in flight together
_TARGET_PROGRAMS = 256  # enough (B x kv_heads x splits) programs to fill a large GPU
_MIN_KEYS_PER_SPLIT = 128  # one BLOCK_N tile


@triton.jit
def _rotated(ptrs, d, mask, cos, sin, HALF: tl.constexpr):
    """Rows at `ptrs` (+ d, the head dims on the last axis) under the NeoX rotary embedding,
    as fused._rotate computes it (float32, then the rows' dtype): fma(x1, cos, -x2 * sin) in
    the first half, fma(x2, cos, x1 * sin) in the second; `cos`/`sin` indexed by d % HALF."""
    first = d < HALF
    x = tl.load(ptrs + d, mask=mask, other=0.0)
    partner = tl.load(ptrs + tl.where(first, d + HALF, d - HALF), mask=mask, other=0.0)
    x32, p32 = x.to(tl.float32), partner.to(tl.float32)
    out = tl.fma(x32, cos, tl.where(first, -(p32 * sin), p32 * sin))  # as fused._rotate
    return out.to(x.dtype)


@triton.jit
def _write_newest(
    key_ptr, value_ptr, slot, k_cache_ptr, v_cache_ptr, b64, kv_head, k_scale, v_scale,
    stride_kb, stride_kh, stride_vb, stride_vh, stride_cb, stride_cs, stride_ch, cos, sin,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
    QUANT: tl.constexpr, FP8_MAX: tl.constexpr, ROUND: tl.constexpr, MANT: tl.constexpr,
    MIN_ULP: tl.constexpr, ROTARY: tl.constexpr,
):  # fmt: skip
    """Sequence b's newest K/V of `kv_head` to its slot (>= 0), stored as
    _reshape_and_cache_kernel stores it (_store_kv); under ROTARY, K rotated first (cos/sin of
    its position). Returns what was stored (the cache's dtype, zeros past HEAD_DIM)."""
    d = tl.arange(0, HEAD_PAD)
    mask = d < HEAD_DIM
    k_row = key_ptr + b64 * stride_kb + kv_head * stride_kh
    if ROTARY:
        k = _rotated(k_row, d, mask, cos, sin, HEAD_DIM // 2)
    else:
        k = tl.load(k_row + d, mask=mask, other=0.0)
    v = tl.load(value_ptr + b64 * stride_vb + kv_head * stride_vh + d, mask=mask, other=0.0)
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
    dst += kv_head * stride_ch + d
    ks, vs = k_scale, v_scale
    if QUANT:  # (div_rn takes operands of one shape)
        ks = tl.broadcast_to(k_scale, (HEAD_PAD,))
        vs = tl.broadcast_to(v_scale, (HEAD_PAD,))
    return _store_kv(k_cache_ptr, v_cache_ptr, dst, k, v, ks, vs, mask, QUANT, FP8_MAX, ROUND,
                     MANT, MIN_ULP)  # fmt: skip


@triton.jit
def _partition(seq_len, window, num_splits, HAS_WINDOW: tl.constexpr, BLOCK_N: tl.constexpr):
    """A sequence's keys [lo, seq_len) in splits of `chunk` (whole BLOCK_N tiles, balanced),
    and how many splits hold keys (`used`, at least 1: split 0 writes a 0-length context's
    zeros). A graph launches MAX_SPLITS, so at a short context most splits are empty."""
    lo = 0
    if HAS_WINDOW:  # the query (position seq_len - 1) sees keys > seq_len - 1 - window
        lo = tl.maximum(seq_len - window, 0)
    span = seq_len - lo
    chunk = ((span + num_splits - 1) // num_splits + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    used = tl.maximum((span + chunk - 1) // tl.maximum(chunk, 1), 1)
    return lo, chunk, used


# Arguments that vary from step to step are not specialised on (Triton compiles a variant for
# an int equal to 1 or divisible by 16): a new variant met while serving costs a compile.
@triton.jit(do_not_specialize=["window", "stride_bt", "num_splits"])
def _split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    ws_ptr,
    count_ptr,
    seq_lens_ptr,
    bt_ptr,
    k_scale_ptr,
    v_scale_ptr,
    key_ptr,
    value_ptr,
    slot_ptr,
    pos_ptr,
    cos_sin_ptr,
    stride_rope,
    qk_scale,
    cap_log2e,
    window,
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_bt,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_wb,
    stride_wh,
    stride_ws,
    stride_kb,
    stride_kh,
    stride_vb,
    stride_vh,
    num_splits,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    TICKET: tl.constexpr,  # merged by the program that takes the last ticket (else later)
    SPLIT: tl.constexpr,  # num_splits > 1: partials to the workspace, merged by the last
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    QUANT: tl.constexpr,
    F16: tl.constexpr,  # an fp8 cache read as fp16 (q cast too): see fp8_as_f16
    WRITE_KV: tl.constexpr,  # write this step's key/value to the cache first
    ROTARY: tl.constexpr,  # q and the key un-rotated: rotate them here (with WRITE_KV)
    FP8_MAX: tl.constexpr,
    ROUND: tl.constexpr,
    MANT: tl.constexpr,
    MIN_ULP: tl.constexpr,
    PDL: tl.constexpr,
):
    # Before the PDL wait: what only earlier steps or the host write (lengths, block table,
    # positions, scales and, when this launch writes the step's K/V, the cached K/V).
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    lo, chunk, used = _partition(seq_len, window, num_splits, HAS_WINDOW, BLOCK_N)
    start = lo + split * chunk
    end = tl.minimum(start + chunk, seq_len)
    if split >= used:  # no keys: the merge skips this split (split 0 always waits: pdl.py)
        return
    b64 = b.to(tl.int64)

    k_scale = 1.0
    v_scale = 1.0
    if QUANT:  # fp8 cache: K's scale folds into the scores, V's into the output
        k_scale = tl.load(k_scale_ptr + kv_head)
        v_scale = tl.load(v_scale_ptr + kv_head)
        qk_scale = qk_scale * k_scale
    d = tl.arange(0, HEAD_PAD)
    cos = tl.zeros([HEAD_PAD], tl.float32)
    sin = tl.zeros([HEAD_PAD], tl.float32)
    if ROTARY:  # cos/sin of the token's position, for q and the newest key
        rope_row = cos_sin_ptr + tl.load(pos_ptr + b64).to(tl.int64) * stride_rope
        cos = tl.load(rope_row + d % (HEAD_DIM // 2)).to(tl.float32)
        sin = tl.load(rope_row + HEAD_DIM // 2 + d % (HEAD_DIM // 2)).to(tl.float32)
    bt_row = bt_ptr + b64 * stride_bt
    first = start
    if WRITE_KV:  # the first tile now; the newest token (written below) put in from registers
        slot = tl.load(slot_ptr + b64).to(tl.int64)
        newest = tl.where(slot >= 0, seq_len - 1, -1)  # slot < 0: padding, nothing written
        pos0 = start + tl.arange(0, BLOCK_N)
        k0, v0 = _load_kv_tile(
            k_cache_ptr, v_cache_ptr, bt_row, kv_head, pos0, pos0 < end,
            stride_cb, stride_cs, stride_ch, BLOCK_SIZE, HEAD_DIM, HEAD_PAD,
        )  # fmt: skip
        first = start + BLOCK_N

    pdl.enter(PDL)
    if WRITE_KV:  # the newest token (position seq_len - 1) is in this split: cache it first
        if (start <= newest) & (newest < end):
            k_new, v_new = _write_newest(
                key_ptr, value_ptr, slot, k_cache_ptr, v_cache_ptr, b64, kv_head, k_scale,
                v_scale, stride_kb, stride_kh, stride_vb, stride_vh, stride_cb, stride_cs,
                stride_ch, cos, sin, BLOCK_SIZE, HEAD_DIM, HEAD_PAD, QUANT, FP8_MAX, ROUND,
                MANT, MIN_ULP, ROTARY,
            )  # fmt: skip
            k0 = tl.where(pos0[None, :] == newest, k_new[:, None], k0)
            v0 = tl.where(pos0[:, None] == newest, v_new[None, :], v0)
        tl.debug_barrier()  # the program's threads read it below

    g = tl.arange(0, BLOCK_H)
    row_ok = g < GROUP
    head = kv_head * GROUP + g
    io_mask = _dim_mask(row_ok, HEAD_DIM, HEAD_PAD)
    q_rows = q_ptr + b64 * stride_qb + head[:, None] * stride_qh
    if ROTARY:
        q = _rotated(q_rows, d[None, :], io_mask, cos[None, :], sin[None, :], HEAD_DIM // 2)
    else:
        q = tl.load(q_rows + d[None, :], mask=io_mask, other=0.0)
    if F16:
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)

    m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_PAD], tl.float32)
    if WRITE_KV:  # the first tile, loaded before the wait
        k_t, v = _dequant_tile(k0, v0, q, QUANT, UPCAST)
        acc, m_i, l_i = _softmax_step(
            q, k_t, v, acc, m_i, l_i, (pos0 < end)[None, :], qk_scale, IEEE, UPCAST,
            SOFTCAP=SOFTCAP, cap_log2e=cap_log2e,
        )  # fmt: skip
    for s0 in range(first, end, BLOCK_N):
        pos = s0 + tl.arange(0, BLOCK_N)
        valid = pos < end
        k_t, v = _load_kv_tile(
            k_cache_ptr, v_cache_ptr, bt_row, kv_head, pos, valid,
            stride_cb, stride_cs, stride_ch, BLOCK_SIZE, HEAD_DIM, HEAD_PAD,
        )  # fmt: skip
        k_t, v = _dequant_tile(k_t, v, q, QUANT, UPCAST)
        mask = valid[None, :]
        acc, m_i, l_i = _softmax_step(
            q, k_t, v, acc, m_i, l_i, mask, qk_scale, IEEE, UPCAST,
            SOFTCAP=SOFTCAP, cap_log2e=cap_log2e,
        )  # fmt: skip

    if QUANT:
        acc = acc * v_scale
    o_ptrs = out_ptr + b64 * stride_ob + head[:, None] * stride_oh + d[None, :]
    if (not SPLIT) or used == 1:  # what merging one split would write
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        w_row = ws_ptr + b64 * stride_wb + head * stride_wh  # [BLOCK_H]: split 0 of each head
        w = w_row + split * stride_ws
        tl.store(w[:, None] + d[None, :], acc, mask=io_mask)
        tl.store(w + HEAD_DIM, m_i, mask=row_ok)
        tl.store(w + HEAD_DIM + 1, l_i, mask=row_ok)
        if TICKET:
            _merge_if_last(w_row, o_ptrs, count_ptr, b * tl.num_programs(1) + kv_head, used,
                           stride_ws, row_ok, io_mask, d, HEAD_DIM, HEAD_PAD,
                           BLOCK_H)  # fmt: skip


@triton.jit
def _merge(w_row, o_ptrs, num_splits, stride_ws, row_ok, io_mask, d, HEAD_DIM: tl.constexpr,
           HEAD_PAD: tl.constexpr, BLOCK_H: tl.constexpr):  # fmt: skip
    """Merge the partials at w_row (one row a query head) into o_ptrs, as the splits' own
    softmax states: the max over splits (one load of every split's max), then the sums
    rescaled to it, in split order, UNROLL splits' loads issued together."""
    s = tl.arange(0, _SPLITS)
    m_all = tl.load(w_row[:, None] + s[None, :] * stride_ws + HEAD_DIM,
                    mask=row_ok[:, None] & (s[None, :] < num_splits), other=-1.0e30,
                    cache_modifier=".cg")  # fmt: skip
    m = tl.max(m_all, 1)
    denom = tl.zeros([BLOCK_H], tl.float32)
    total = tl.zeros([BLOCK_H, HEAD_PAD], tl.float32)
    for s0 in range(0, num_splits, _UNROLL):
        for j in tl.static_range(_UNROLL):  # past num_splits: masked, adds zeros
            ok = row_ok & (tl.full([BLOCK_H], s0 + j, tl.int32) < num_splits)
            ws = w_row + (s0 + j) * stride_ws
            m_s = tl.load(ws + HEAD_DIM, mask=ok, other=-1.0e30, cache_modifier=".cg")
            l_s = tl.load(ws + HEAD_DIM + 1, mask=ok, other=0.0, cache_modifier=".cg")
            acc_s = tl.load(ws[:, None] + d[None, :], mask=io_mask & ok[:, None], other=0.0,
                            cache_modifier=".cg")  # fmt: skip
            scale = tl.exp2(m_s - m)
            denom += scale * l_s
            total += acc_s * scale[:, None]
    o = total / tl.where(denom == 0.0, 1.0, denom)[:, None]
    tl.store(o_ptrs, o.to(o_ptrs.dtype.element_ty), mask=io_mask)


@triton.jit
def _merge_if_last(w_row, o_ptrs, count_ptr, slot, num_splits, stride_ws, row_ok, io_mask, d,
                   HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
                   BLOCK_H: tl.constexpr):  # fmt: skip
    """Take the (sequence, KV head)'s ticket; the program that takes the last merges and
    zeroes the counter for the next launch."""
    tl.debug_barrier()  # every thread's partial stored before the ticket (release)
    if tl.atomic_add(count_ptr + slot, 1) == num_splits - 1:  # acq_rel: partials visible
        _merge(w_row, o_ptrs, num_splits, stride_ws, row_ok, io_mask, d, HEAD_DIM, HEAD_PAD,
               BLOCK_H)  # fmt: skip
        tl.atomic_xchg(count_ptr + slot, 0)


@triton.jit(do_not_specialize=["window", "num_splits"])
def _reduce_kernel(
    ws_ptr, out_ptr, seq_lens_ptr, window, stride_wb, stride_wh, stride_ws, stride_ob,
    stride_oh, num_splits, GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr, HAS_WINDOW: tl.constexpr, BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """The merge as a second launch, one program per (sequence, KV head): of the splits that
    hold keys (one: the split kernel wrote `out`)."""
    _, _, used = _partition(tl.load(seq_lens_ptr + tl.program_id(0)), window, num_splits,
                            HAS_WINDOW, BLOCK_N)  # fmt: skip
    pdl.enter(PDL)  # even with nothing to merge: o_proj after it must see the split kernel done
    if used == 1:
        return
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    g = tl.arange(0, BLOCK_H)
    row_ok = g < GROUP
    head = kv_head * GROUP + g
    d = tl.arange(0, HEAD_PAD)
    io_mask = _dim_mask(row_ok, HEAD_DIM, HEAD_PAD)
    w_row = ws_ptr + b * stride_wb + head * stride_wh
    o_ptrs = out_ptr + b * stride_ob + head[:, None] * stride_oh + d[None, :]
    _merge(w_row, o_ptrs, used, stride_ws, row_ok, io_mask, d, HEAD_DIM, HEAD_PAD,
           BLOCK_H)  # fmt: skip


def choose_num_splits(batch: int, num_kv_heads: int, max_seq_len: int) -> int:
    """Splits so that B x kv_heads x splits fills the GPU, each split >= 128 keys."""
    by_len = triton.cdiv(max(max_seq_len, 1), _MIN_KEYS_PER_SPLIT)
    by_grid = triton.cdiv(_TARGET_PROGRAMS, max(batch * num_kv_heads, 1))
    return max(1, min(by_len, by_grid, MAX_SPLITS))


def decode_workspace(
    max_batch: int,
    num_heads: int,
    head_dim: int,
    num_splits: int = MAX_SPLITS,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """fp32 `[max_batch, num_heads, num_splits, head_dim + 2]` (acc, then max, then sum)."""
    return torch.empty(max_batch, num_heads, num_splits, head_dim + 2, dtype=torch.float32,
                       device=device)  # fmt: skip


def decode_counters(
    max_batch: int, num_kv_heads: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """int32 zeros `[max_batch * num_kv_heads]`: the split-K tickets; every launch leaves them
    zero, so one buffer serves every layer and CUDA graph."""
    return torch.zeros(max_batch * num_kv_heads, dtype=torch.int32, device=device)


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_seq_len: int,
    num_splits: int | None = None,
    workspace: torch.Tensor | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
    window: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    f16: bool | None = None,
    counters: torch.Tensor | None = None,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its whole cached context (its last
    `window` positions with a window); writes `out`. `softcap`, and `k_scale`/`v_scale` of
    an fp8 cache, as in paged_attention_varlen.

    q/out `[B, num_heads, head_dim]`; seq_lens int32 `[B]` (0 gives zeros); block_tables
    int32 `[B, max_blocks]`. For CUDA graphs pass a fixed `num_splits`, a `workspace` from
    `decode_workspace` (any buffer with dims >= `[B, num_heads, num_splits, D + 2]`).
    `counters` from `decode_counters` (int32 zeros, >= B * kv_heads; left zero): the splits
    merge in the same launch (the last to finish); without, a second launch merges them.

    `key`/`value` `[B, kv_heads, head_dim]` with `slot_mapping` `[B]`: this step's K/V,
    written to the cache first as `reshape_and_cache` would (slot < 0 skipped); each is
    sequence b's newest token, position seq_lens[b] - 1.

    `rotary` (positions `[B]`, cos_sin_cache `[max_pos, head_dim]`, as fused.rotary_embedding
    takes them; every dim rotated, head_dim a power of two): q and `key` are not yet rotated;
    the kernel rotates them as rotary_embedding would (q is not changed in memory).
    """
    group = check_attention_args(q, k_cache, v_cache)
    assert out.shape == q.shape and out.stride(-1) == 1
    batch, num_heads, head_dim = q.shape
    if batch == 0:
        return out
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, max_seq_len)
    assert 1 <= num_splits <= MAX_SPLITS
    if num_splits > 1:
        if workspace is None:
            workspace = decode_workspace(batch, num_heads, head_dim, num_splits, q.device)
        assert workspace.dtype == torch.float32 and workspace.stride(-1) == 1
        assert workspace.shape[0] >= batch and workspace.shape[1] == num_heads
        assert workspace.shape[2] >= num_splits and workspace.shape[3] >= head_dim + 2
        if counters is not None:
            assert counters.dtype == torch.int32 and counters.numel() >= batch * num_kv_heads
        ws, ws_strides = workspace, workspace.stride()[:3]
    else:
        ws, ws_strides = out, (0, 0, 0)  # unused
    ticket = num_splits > 1 and counters is not None
    write = key is not None
    if write:
        assert value is not None and slot_mapping is not None
        assert key.shape == (batch, num_kv_heads, head_dim) and value.shape == key.shape
        assert key.stride(-1) == 1 and value.stride(-1) == 1, "last dim must be contiguous"
        assert slot_mapping.shape[0] >= batch
        kv_args = (key, value, slot_mapping, key.stride(0), key.stride(1), value.stride(0),
                   value.stride(1))  # fmt: skip
    else:
        kv_args = (seq_lens, seq_lens, seq_lens, 0, 0, 0, 0)  # unread
    if rotary is not None:
        positions, cos_sin = rotary
        assert write, "the rotary embedding inside needs the step's key to write"
        assert cos_sin.shape[-1] == head_dim == head_pad(head_dim) and cos_sin.stride(-1) == 1
        assert positions.shape[0] >= batch
        rope_args = (positions, cos_sin, cos_sin.stride(0))
    else:
        rope_args = (seq_lens, seq_lens, 0)  # unread
    # Tuned on an H200 (bf16, D=128): BLOCK_N 128, 4 warps, 3 stages; K+V tile <= 64 KiB.
    # Platforms with less shared memory (ROCm) pass smaller tiles; these are the defaults.
    pad = head_pad(head_dim)  # tiles are powers of two: other head sizes are masked
    block_n = block_n or min(128, 32768 // (pad * q.element_size()))
    sargs = score_args(scale, window, softcap)
    k_scale, v_scale, quant = kv_scale_args(k_cache, k_scale, v_scale, num_kv_heads)
    fp8 = fp8_args(k_cache)
    del fp8["QUANT"]
    block_h = max(16, triton.next_power_of_2(group))  # a KV head's query rows, for tl.dot
    _split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, out, ws, counters if ticket else seq_lens, seq_lens, block_tables,
        k_scale if quant else seq_lens, v_scale if quant else seq_lens,  # unread unless QUANT
        *kv_args[:3], *rope_args, sargs["qk_scale"], sargs["cap_log2e"], sargs["window"],
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), *ws_strides, *kv_args[3:],
        num_splits, GROUP=group, BLOCK_H=block_h,
        BLOCK_N=block_n, BLOCK_SIZE=block_size, HEAD_DIM=head_dim, HEAD_PAD=pad,
        SPLIT=num_splits > 1, TICKET=ticket, **dot_flags(q), HAS_WINDOW=sargs["HAS_WINDOW"],
        SOFTCAP=sargs["SOFTCAP"], QUANT=quant,
        F16=fp8_as_f16(q, quant) if f16 is None else f16, WRITE_KV=write,
        ROTARY=rotary is not None, **fp8,
        num_warps=num_warps, num_stages=num_stages, **pdl.launch()
    )  # fmt: skip
    if num_splits > 1 and not ticket:
        _reduce_kernel[(batch, num_kv_heads)](
            ws, out, seq_lens, sargs["window"], *ws_strides, out.stride(0), out.stride(1),
            num_splits, GROUP=group, BLOCK_H=block_h, HEAD_DIM=head_dim, HEAD_PAD=pad,
            HAS_WINDOW=sargs["HAS_WINDOW"], BLOCK_N=block_n, num_warps=4, **pdl.launch()
        )  # fmt: skip
    return out
