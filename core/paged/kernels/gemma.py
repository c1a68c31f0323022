"""Gemma's fused elementwise kernels: RMSNorm scaling by (1 + w) (+ the residual add before
it) and GeGLU. Same arithmetic as the torch references in `paged.model.ops`: the norm in
float32 with one cast at the end; gelu in float32 rounded to the model dtype, then times up.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged.kernels import pdl
from paged.kernels.fused import _warps


@triton.jit
def _gemma_rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    n_inner,
    stride_x0,
    stride_x1,
    stride_r0,
    stride_r1,
    n_cols,
    eps,
    BLOCK: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,
):
    """Row `row` of x viewed as [outer, n_inner, n_cols] (strided); out and sum contiguous."""
    pdl.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    i, j = row // n_inner, row % n_inner
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + i * stride_x0 + j * stride_x1 + cols, mask=mask, other=0.0)
    if ADD_RESIDUAL:  # s = residual + x, rounded to the model dtype as the reference does
        r = tl.load(res_ptr + i * stride_r0 + j * stride_r1 + cols, mask=mask, other=0.0)
        x = (r.to(tl.float32) + x.to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * n_cols + cols, x, mask=mask)
    h = x.to(tl.float32)
    var = tl.sum(h * h, 0) / n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = h * tl.rsqrt(var + eps) * (1.0 + w)  # float32 throughout, one cast at the end
    tl.store(out_ptr + row * n_cols + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _as_3d(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] as [outer, inner, D] without a copy where its strides allow (q heads
    [T, H, D] sliced out of a fused projection keep their row stride)."""
    assert x.stride(-1) == 1, "last dim must be contiguous"
    if x.dim() == 3:
        return x
    if x.dim() < 3:  # [T, D] as [T, 1, D]: inner 1, a launch constant
        return (x[None] if x.dim() == 1 else x).unsqueeze(1)
    try:
        return x.view(-1, x.shape[-2], x.shape[-1])
    except RuntimeError:
        return x.reshape(-1, x.shape[-2], x.shape[-1])


def _norm(x, residual, weight, eps):
    n_cols = x.shape[-1]
    assert weight.shape == (n_cols,) and weight.stride(0) == 1
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    total = out if residual is None else torch.empty_like(out)
    x3 = _as_3d(x)
    r3 = x3 if residual is None else _as_3d(residual)
    n_rows = x3.shape[0] * x3.shape[1]
    if n_rows:
        _gemma_rms_norm_kernel[(n_rows,)](
            x3, r3, weight, out, total, x3.shape[1], x3.stride(0), x3.stride(1), r3.stride(0),
            r3.stride(1), n_cols, eps, BLOCK=triton.next_power_of_2(n_cols),
            ADD_RESIDUAL=residual is not None, num_warps=_warps(n_cols), **pdl.launch()
        )  # fmt: skip
    return out, total


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """GemmaRMSNorm over the last dim of x [..., D] (a new contiguous tensor):
    x * rsqrt(mean(x^2) + eps) * (1 + w), all in float32, then cast to x's dtype."""
    return _norm(x, None, weight, eps)[0]


def gemma_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """s = residual + x (rounded to x's dtype); returns (gemma_rms_norm(s), s) as new
    tensors. Neither input is changed."""
    assert x.shape == residual.shape
    return _norm(x, residual, weight, eps)


@triton.jit
def _gelu_and_mul_kernel(
    x_ptr,
    out_ptr,
    stride_x,
    stride_o,
    n_cols,
    BLOCK: tl.constexpr,
    TANH: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0)
    if TANH:  # 0.5 * g * (1 + tanh(u)) as g * sigmoid(2u): no cancellation; exp -> inf gives -0
        u = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)  # sqrt(2 / pi)
        act = gate / (1.0 + tl.exp(-2.0 * u))
    else:  # erf
        act = 0.5 * gate * (1.0 + tl.erf(gate * 0.7071067811865476))
    act = act.to(up.dtype)  # rounded like torch's gelu in the model dtype
    y = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def gelu_and_mul(x: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """GeGLU: gelu(x[..., :I], approximate) * x[..., I:] for x [..., 2*I] (a new tensor);
    approximate "tanh" (gelu_pytorch_tanh, Gemma's) or "none" (erf)."""
    if approximate not in ("tanh", "none"):
        raise ValueError(f"gelu_and_mul: approximate={approximate!r}")
    assert x.stride(-1) == 1 and x.shape[-1] % 2 == 0, "last dim: contiguous, even"
    inter = x.shape[-1] // 2
    out = x.new_empty(*x.shape[:-1], inter)
    if out.numel():
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        o2 = out.view(-1, inter)
        block = min(1024, triton.next_power_of_2(inter))
        _gelu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
            x2, o2, x2.stride(0), o2.stride(0), inter, BLOCK=block,
            TANH=approximate == "tanh", num_warps=4, **pdl.launch()
        )  # fmt: skip
    return out
