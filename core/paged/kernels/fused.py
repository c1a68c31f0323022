"""Fused elementwise kernels: RMSNorm (+ residual add), rotary embedding (+ a per-head RMSNorm
before it), SiLU-and-mul."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged.kernels import pdl
from paged.kernels.compile_ahead import launcher


@triton.jit
def rms_scaled(h, rstd, w, dtype: tl.constexpr):
    """HF Llama's RMSNorm rounding, in float32: weight * (h * rstd).to(dtype) (rstd: the row's
    rsqrt(mean(h^2) + eps)); every kernel that applies such a norm rounds through here."""
    return w.to(tl.float32) * (h.to(tl.float32) * rstd).to(dtype).to(tl.float32)


@triton.jit
def silu_mul(gate, up):
    """silu(gate) * up as silu_and_mul rounds it: silu in float32 rounded to up's dtype (as
    torch's silu in that dtype), the product in float32 (the caller rounds it for its output);
    every kernel that applies SiLU-and-mul computes it here."""
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(up.dtype)
    return act.to(tl.float32) * up.to(tl.float32)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    stride_x,
    stride_r,
    stride_o,
    n_cols,
    eps,
    amax_ptr,
    BLOCK: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
    AMAX: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if ADD_RESIDUAL:  # residual += x, rounded to the model dtype as the reference does
        r_ptrs = res_ptr + row * stride_r + cols
        x = (x.to(tl.float32) + tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)).to(
            res_ptr.dtype.element_ty
        )
        tl.store(r_ptrs, x, mask=mask)
    h = x.to(tl.float32)
    var = tl.sum(h * h, 0) / n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = rms_scaled(h, tl.rsqrt(var + eps), w, x_ptr.dtype.element_ty)
    y = y.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, y, mask=mask)
    if AMAX:  # the output row's absmax (an fp8 linear's per-token scale after it)
        tl.store(amax_ptr + row, tl.max(tl.abs(y.to(tl.float32)), 0))


def _rows(x: torch.Tensor) -> torch.Tensor:
    assert x.stride(-1) == 1, "last dim must be contiguous"
    return x.view(-1, x.shape[-1]) if x.dim() != 2 else x


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """LlamaRMSNorm over the last dim, fp32 math; allocates `out` when not given."""
    if out is None:
        out = torch.empty_like(x)
    x2, o2 = _rows(x), _rows(out)
    n_rows, n_cols = x2.shape
    if n_rows:
        launcher(_rms_norm_kernel, (n_rows,))(
            x2, x2, weight, o2, x2.stride(0), 0, o2.stride(0), n_cols, eps, o2,
            BLOCK=triton.next_power_of_2(n_cols), ADD_RESIDUAL=False, AMAX=False,
            num_warps=_warps(n_cols), **pdl.launch(),
        )  # fmt: skip
    return out


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: `residual += x; x = rms_norm(residual)`. Returns `(x, residual)`. `amax`
    (float32, one a row): each output row's absmax written there too."""
    assert x.shape == residual.shape
    x2, r2 = _rows(x), _rows(residual)
    n_rows, n_cols = x2.shape
    if n_rows:
        launcher(_rms_norm_kernel, (n_rows,))(
            x2, r2, weight, x2, x2.stride(0), r2.stride(0), x2.stride(0), n_cols, eps,
            amax if amax is not None else x2, BLOCK=triton.next_power_of_2(n_cols),
            ADD_RESIDUAL=True, AMAX=amax is not None, num_warps=_warps(n_cols), **pdl.launch(),
        )  # fmt: skip
    return x, residual


def _warps(n: int) -> int:
    return 4 if n <= 2048 else 8 if n <= 8192 else 16


@triton.jit
def _rotate(ptr, stride_t, stride_h, t, n_heads, cos, sin, w_ptr, eps, BLOCK_H: tl.constexpr,
            HALF: tl.constexpr, HALF_PAD: tl.constexpr, NORM: tl.constexpr):  # fmt: skip
    """Rotate the first 2*HALF dims of every head of token t in place (NeoX style). NORM 1:
    first an RMSNorm of each head (2*HALF dims, all rotated) by weight w_ptr, as rms_norm
    computes it (Qwen3's q_norm / k_norm); NORM 2: Gemma's, (1 + w) in float32, cast once."""
    h = tl.arange(0, BLOCK_H)
    c = tl.arange(0, HALF_PAD)
    mask = (h < n_heads)[:, None]
    if HALF_PAD != HALF:  # a rotary width that is not a power of two: mask the tail
        mask = mask & (c < HALF)[None, :]
    p1 = ptr + t * stride_t + h[:, None] * stride_h + c[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0)
    if NORM != 0:
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        var = (tl.sum(f1 * f1, 1) + tl.sum(f2 * f2, 1)) / (2 * HALF)
        rstd = tl.rsqrt(var + eps)[:, None]
        w1 = tl.load(w_ptr + c, mask=c < HALF, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + c, mask=c < HALF, other=0.0).to(tl.float32)[None, :]
        if NORM == 1:  # HF Llama/Qwen3: weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)
            x1 = rms_scaled(f1, rstd, w1, x1.dtype).to(x1.dtype)
            x2 = rms_scaled(f2, rstd, w2, x2.dtype).to(x2.dtype)
        else:  # HF Gemma: x * rsqrt(mean(x^2) + eps) * (1 + weight), float32, cast once
            x1 = (f1 * rstd * (1.0 + w1)).to(x1.dtype)
            x2 = (f2 * rstd * (1.0 + w2)).to(x2.dtype)
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    # Explicit FMAs: the rounding cannot vary with the compiler's contraction, so the decode
    # kernel's rotation (decode._rotated) gives the same bits.
    o1 = tl.fma(x1, cos[None, :], -(x2 * sin[None, :]))
    o2 = tl.fma(x2, cos[None, :], x1 * sin[None, :])
    tl.store(p1, o1.to(ptr.dtype.element_ty), mask=mask)
    tl.store(p1 + HALF, o2.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    pos_ptr,
    q_ptr,
    k_ptr,
    cache_ptr,
    qw_ptr,
    kw_ptr,
    eps,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cache,
    n_q_heads,
    n_k_heads,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    NORM: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    c = tl.arange(0, HALF_PAD)
    ok = c < HALF
    cos = tl.load(cache_ptr + pos * stride_cache + c, mask=ok, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + c, mask=ok, other=0.0).to(tl.float32)
    _rotate(q_ptr, stride_qt, stride_qh, t, n_q_heads, cos, sin, qw_ptr, eps, BLOCK_HQ, HALF,
            HALF_PAD, NORM)  # fmt: skip
    _rotate(k_ptr, stride_kt, stride_kh, t, n_k_heads, cos, sin, kw_ptr, eps, BLOCK_HK, HALF,
            HALF_PAD, NORM)  # fmt: skip


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_dim: int,
    norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    gemma_norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """In-place NeoX ("rotate_half") rotary on q `[T, Hq, D]`, k `[T, Hk, D]` (strided views).

    cos_sin_cache `[max_pos, rot_dim]`: cos in the first rot_dim/2 columns, sin in the rest;
    rot_dim (even, <= head_dim) leading dims of each head are rotated. `norm` (q weight, k
    weight, eps): RMSNorm each head first (Qwen3's q_norm / k_norm; `gemma_norm`: Gemma 3's),
    in the same kernel when every dim is rotated.
    """
    num_tokens = positions.shape[0]
    rot_dim = cos_sin_cache.shape[-1]
    assert q.shape[-1] == head_dim and k.shape[-1] == head_dim and rot_dim <= head_dim
    assert rot_dim >= 2 and rot_dim % 2 == 0, "rotary dim must be even"
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos_sin_cache.stride(-1) == 1
    if norm is not None and rot_dim != head_dim:  # the unrotated tail needs its own pass
        q_w, k_w, eps = norm
        if gemma_norm:
            from paged.kernels.gemma import gemma_rms_norm as head_norm
        else:
            head_norm = rms_norm
        q = head_norm(q.reshape(-1, head_dim), q_w, eps).view(q.shape)
        k = head_norm(k.reshape(-1, head_dim), k_w, eps).view(k.shape)
        norm = None
    if num_tokens:
        q_w, k_w, eps = norm if norm is not None else (q, k, 0.0)  # unread without NORM
        _rotary_kernel[(num_tokens,)](
            positions, q, k, cos_sin_cache, q_w, k_w, eps, q.stride(0), q.stride(1), k.stride(0),
            k.stride(1), cos_sin_cache.stride(0), q.shape[1], k.shape[1], HALF=rot_dim // 2,
            HALF_PAD=triton.next_power_of_2(rot_dim // 2),
            BLOCK_HQ=triton.next_power_of_2(q.shape[1]),
            BLOCK_HK=triton.next_power_of_2(k.shape[1]),
            NORM=0 if norm is None else 2 if gemma_norm else 1, num_warps=4, **pdl.launch()
        )  # fmt: skip
    return q, k


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, amax_ptr, stride_x, stride_o, n_cols, BLOCK: tl.constexpr,
    AMAX: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0)
    y = silu_mul(gate, up).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, y, mask=mask)
    if AMAX:  # this block's absmax of the output (an fp8 linear's per-token scale after it)
        blocks = tl.num_programs(1)
        tl.store(amax_ptr + row * blocks + tl.program_id(1), tl.max(tl.abs(y.to(tl.float32)), 0))


def _silu_block(inter: int) -> int:
    return min(1024, triton.next_power_of_2(inter))


def silu_and_mul(
    x: torch.Tensor, out: torch.Tensor | None = None, amax: torch.Tensor | None = None
) -> torch.Tensor:
    """`silu(x[..., :I]) * x[..., I:]` for x `[..., 2*I]`; allocates `out` when not given.
    `amax` (float32 [rows, blocks]: silu_and_mul_absmax's): each block's absmax written there."""
    inter = x.shape[-1] // 2
    if out is None:
        out = x.new_empty(*x.shape[:-1], inter)
    x2, o2 = _rows(x), _rows(out)
    if x2.shape[0]:
        block = _silu_block(inter)
        launcher(_silu_and_mul_kernel, (x2.shape[0], triton.cdiv(inter, block)))(
            x2, o2, amax if amax is not None else o2, x2.stride(0), o2.stride(0), inter,
            BLOCK=block, AMAX=amax is not None, num_warps=4, **pdl.launch(),
        )  # fmt: skip
    return out


def silu_and_mul_absmax(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(silu_and_mul(x) [M, I], float32 [M, P]: the absmax of each block of it) for x [M, 2I]:
    the activation before an fp8 down projection with what its per-token scale needs, the max
    of P numbers left to the GEMV (`fp8_gemv.fp8_gemv_split(x_amax=...)`)."""
    inter = x.shape[-1] // 2
    amax = torch.empty(x.shape[0], triton.cdiv(inter, _silu_block(inter)), dtype=torch.float32,
                       device=x.device)  # fmt: skip
    return silu_and_mul(x, amax=amax), amax
