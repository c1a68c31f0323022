"""Pieces shared by the paged-attention kernels: K/V tile gather and online-softmax step."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .head_dims import head_pad, unsupported_head_dim

__all__ = [
    "LOG2E", "check_attention_args", "dot_flags", "fp8_args", "head_pad", "kv_scale_args",
    "score_args",
]  # fmt: skip

LOG2E = 1.4426950408889634


@triton.jit
def _load_kv_tile(
    k_cache_ptr,
    v_cache_ptr,
    bt_row_ptr,
    kv_head,
    pos,
    valid,
    stride_cb,
    stride_cs,
    stride_ch,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
):
    """K^T `[HEAD_PAD, BLOCK_N]` and V `[BLOCK_N, HEAD_PAD]` for logical positions `pos`;
    dims past HEAD_DIM (a head size that is not a power of two) read as zeros."""
    blk = tl.load(bt_row_ptr + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    base = blk * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
    d = tl.arange(0, HEAD_PAD)
    k_mask = valid[None, :]
    v_mask = valid[:, None]
    if HEAD_PAD != HEAD_DIM:
        k_mask = k_mask & (d < HEAD_DIM)[:, None]
        v_mask = v_mask & (d < HEAD_DIM)[None, :]
    k_t = tl.load(k_cache_ptr + base[None, :] + d[:, None], mask=k_mask, other=0.0)
    v = tl.load(v_cache_ptr + base[:, None] + d[None, :], mask=v_mask, other=0.0)
    return k_t, v


@triton.jit
def _dequant_tile(k_t, v, q, QUANT: tl.constexpr, UPCAST: tl.constexpr):
    """fp8 K/V tiles in q's dtype (fp32 under the CPU interpreter); the per-head scales are
    applied to the scores (k) and the output (v), not here."""
    # One return: the compiler types every return statement, even one under a false
    # constexpr branch, and refuses returns of different types.
    if QUANT:
        if UPCAST:
            k_t, v = k_t.to(tl.float32), v.to(tl.float32)
        else:
            k_t, v = k_t.to(q.dtype), v.to(q.dtype)
    return k_t, v


@triton.jit
def _to_fp8(x, FP8_MAX: tl.constexpr, ROUND: tl.constexpr, MANT: tl.constexpr,
            MIN_ULP: tl.constexpr):  # fmt: skip
    """fp32 x saturated to +-FP8_MAX, ready to store into an fp8 cache. ROUND (the CPU
    interpreter, whose fp32->fp8 cast drops the carry of a round-up into the exponent): round
    to the fp8 grid here, to nearest even, so that the cast is exact."""
    x = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)
    if ROUND:
        bits = x.to(tl.int32, bitcast=True)
        drop: tl.constexpr = 23 - MANT
        bits = (bits + ((1 << (drop - 1)) - 1) + ((bits >> drop) & 1)) & (-(1 << drop))
        magic: tl.constexpr = MIN_ULP * 12582912.0  # 1.5 * 2**23 ulps: rounds to a multiple
        a = tl.abs(x)
        sub = (a + magic) - magic  # subnormals: multiples of MIN_ULP, the sign kept (-0.0)
        sub = tl.where(x < 0, -sub, sub)
        x = tl.where(a < MIN_ULP * (1 << MANT), sub, bits.to(tl.float32, bitcast=True))
    return x


@triton.jit
def _store_kv(k_cache_ptr, v_cache_ptr, dst, k, v, ks, vs, mask, QUANT: tl.constexpr,
              FP8_MAX: tl.constexpr, ROUND: tl.constexpr, MANT: tl.constexpr,
              MIN_ULP: tl.constexpr):  # fmt: skip
    """Store K/V tiles at cache offsets `dst`. An fp8 cache (QUANT) stores x / scale (IEEE
    division, as torch's) saturated to the fp8 range; `ks`/`vs` are the scales in the tiles'
    shape. Returns what was stored (in the cache's dtype)."""
    if QUANT:
        k = _to_fp8(tl.math.div_rn(k.to(tl.float32), ks), FP8_MAX, ROUND, MANT, MIN_ULP)
        v = _to_fp8(tl.math.div_rn(v.to(tl.float32), vs), FP8_MAX, ROUND, MANT, MIN_ULP)
    k = k.to(k_cache_ptr.dtype.element_ty)
    v = v.to(v_cache_ptr.dtype.element_ty)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)
    return k, v


@triton.jit
def _dim_mask(rows_ok, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr):
    """`[rows, HEAD_PAD]` mask of real rows and real head dims (all dims when unpadded)."""
    mask = rows_ok[:, None]
    if HEAD_PAD != HEAD_DIM:
        mask = mask & (tl.arange(0, HEAD_PAD) < HEAD_DIM)[None, :]
    return mask


@triton.jit
def _dot(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:  # the CPU interpreter multiplies bf16 storage (uint16) as ints: go via fp32
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision="ieee") if IEEE else tl.dot(a, b)


@triton.jit
def _tanh(x):
    """tanh from exp2 (portable: no libdevice); saturates to +-1 for large |x|."""
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * 1.4426950408889634)) + 1.0)


@triton.jit
def _softmax_step(
    q,
    k_t,
    v,
    acc,
    m_i,
    l_i,
    mask,
    qk_scale,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    MASK: tl.constexpr = True,
    SOFTCAP: tl.constexpr = False,
    cap_log2e=0.0,
):
    """One online-softmax update (log2 domain); masked scores are -inf, m_i starts finite.
    SOFTCAP: qk_scale is scale / cap and the score becomes cap * log2(e) * tanh(.)."""
    s = _dot(q, k_t, IEEE, UPCAST) * qk_scale
    if SOFTCAP:
        s = _tanh(s) * cap_log2e
    if MASK:
        s = tl.where(mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    pv = _dot(p.to(v.dtype), v, IEEE, UPCAST)
    return acc * alpha[:, None] + pv, m_new, l_i


def dot_flags(q: torch.Tensor) -> dict[str, bool]:
    """IEEE fp32 dots for fp32 inputs (no tf32); UPCAST bf16 under the CPU interpreter."""
    cpu = q.device.type == "cpu"  # CPU tensors only run under TRITON_INTERPRET=1
    return {"IEEE": q.dtype == torch.float32 or cpu, "UPCAST": cpu and q.dtype == torch.bfloat16}


def fp8_as_f16(q: torch.Tensor, quant: bool) -> bool:
    """Whether a bf16 query reads an fp8 cache as fp16: fp8 -> fp16 is one instruction on
    NVIDIA sm89+, fp8 -> bf16 several, and the conversion bounds the kernel. q is cast to fp16
    saturated (|q| <= 65504; fp16 keeps more of q's mantissa than bf16)."""
    return quant and q.dtype == torch.bfloat16 and q.device.type != "cpu"


_FP8 = {torch.float8_e4m3fn: (3, 2.0**-9), torch.float8_e5m2: (2, 2.0**-16)}  # mantissa, ulp


def kv_scale_args(
    cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, heads: int
) -> tuple[torch.Tensor | None, torch.Tensor | None, bool]:
    """(k_scale, v_scale, QUANT) for a kernel: an fp8 cache needs float32 `[kv_heads]` scales
    (None: 1.0); other caches none."""
    if cache.dtype not in _FP8:
        assert k_scale is None and v_scale is None, "scales are for an fp8 cache"
        return None, None, False
    if k_scale is None:
        k_scale = torch.ones(heads, dtype=torch.float32, device=cache.device)
    if v_scale is None:
        v_scale = torch.ones(heads, dtype=torch.float32, device=cache.device)
    for s in (k_scale, v_scale):
        assert s.dtype == torch.float32 and s.shape == (heads,) and s.is_contiguous()
    return k_scale, v_scale, True


def fp8_args(cache: torch.Tensor) -> dict:
    """The cache-write kernel's fp8 switches (QUANT off for other caches)."""
    mant, ulp = _FP8.get(cache.dtype, (3, 1.0))
    quant = cache.dtype in _FP8
    return {
        "QUANT": quant,
        "FP8_MAX": float(torch.finfo(cache.dtype).max) if quant else 0.0,
        "ROUND": quant and cache.device.type == "cpu",  # the interpreter's cast: see _to_fp8
        "MANT": mant,
        "MIN_ULP": ulp,
    }


def check_attention_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """Validate shapes shared by both entry points; return the GQA group size."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    assert cache_dim == head_dim and v_cache.shape == k_cache.shape
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    assert q.stride(-1) == 1, "q must have unit stride in the last dim"
    assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    if (why := unsupported_head_dim(head_dim)) is not None:
        raise ValueError(why)
    assert block_size & (block_size - 1) == 0, "block_size must be a power of two"
    return num_heads // num_kv_heads


def score_args(scale: float, window: int | None, softcap: float | None) -> dict:
    """The kernels' score arguments: qk_scale (log2 domain, or scale / cap with a softcap),
    cap_log2e, window (0 = none) and the HAS_WINDOW / SOFTCAP switches."""
    if window is not None and window <= 0:
        raise ValueError(f"window {window} must be positive")
    cap = softcap or 0.0
    return {
        "qk_scale": scale / cap if cap else scale * LOG2E,
        "cap_log2e": cap * LOG2E,
        "window": int(window or 0),
        "HAS_WINDOW": bool(window),
        "SOFTCAP": bool(cap),
    }
