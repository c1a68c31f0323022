"""Write this step's K/V into the paged cache (`[num_blocks, block_size, kv_heads, head_dim]`).

An fp8 cache (--kv-cache-dtype fp8) stores `fp8(clamp(x / scale))` with one float32 scale per
KV head (paged.model.kv_quant is the torch reference).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged.kernels import pdl

from ._attn_common import _store_kv, fp8_args, kv_scale_args


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    num_heads,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    QUANT: tl.constexpr,
    FP8_MAX: tl.constexpr,
    ROUND: tl.constexpr,
    MANT: tl.constexpr,
    MIN_ULP: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.enter(PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padding token
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, HEAD_PAD)
    mask = (h < num_heads)[:, None]
    if HEAD_PAD != HEAD_DIM:  # a head size that is not a power of two: mask the tail
        mask = mask & (d < HEAD_DIM)[None, :]
    t64 = t.to(tl.int64)
    k = tl.load(key_ptr + t64 * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(value_ptr + t64 * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    dst = blk * stride_cb + off * stride_cs + h[:, None] * stride_ch + d[None, :]
    ks = 1.0
    vs = 1.0
    if QUANT:  # per-head scales
        ks = tl.load(k_scale_ptr + h, mask=h < num_heads, other=1.0)[:, None]
        vs = tl.load(v_scale_ptr + h, mask=h < num_heads, other=1.0)[:, None]
        ks, vs = tl.broadcast_to(ks, (BLOCK_H, HEAD_PAD)), tl.broadcast_to(vs, (BLOCK_H, HEAD_PAD))
    _store_kv(k_cache_ptr, v_cache_ptr, dst, k, v, ks, vs, mask, QUANT, FP8_MAX, ROUND, MANT,
              MIN_ULP)  # fmt: skip


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Scatter `key`/`value` `[T, kv_heads, head_dim]` to their slots; slot < 0 is skipped.
    An fp8 cache takes float32 `k_scale`/`v_scale` `[kv_heads]` (stored = value / scale).

    key/value may be strided views (unit stride in the last dim); the caches must share
    one layout (`k_cache.stride() == v_cache.stride()`).
    """
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _, block_size, cache_heads, cache_dim = k_cache.shape
    assert (cache_heads, cache_dim) == (num_heads, head_dim), "key/cache shape mismatch"
    assert value.shape == key.shape and v_cache.shape == k_cache.shape
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    assert key.stride(-1) == 1 and value.stride(-1) == 1, "last dim must be contiguous"
    assert slot_mapping.shape[0] >= num_tokens
    k_scale, v_scale, _ = kv_scale_args(k_cache, k_scale, v_scale, num_heads)
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        k_scale if k_scale is not None else slot_mapping,  # unread unless QUANT
        v_scale if v_scale is not None else slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        num_heads,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        HEAD_PAD=triton.next_power_of_2(head_dim),
        BLOCK_H=triton.next_power_of_2(num_heads),
        **fp8_args(k_cache),
        num_warps=4,
        **pdl.launch(),
    )
