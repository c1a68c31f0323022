"""A decode fp8 linear's input quantized once, with the op before it: the residual add and
RMSNorm (before QKV and gate/up), SiLU-and-mul (before down), or nothing (before o_proj).

One program a row computes the input as the op's own kernel rounds it (fused.rms_scaled,
fused.silu_mul), its per-token scale (token_scale of the absmax) and the e4m3 values
(quantize_e4m3): quantize_fp8_rows of the op's output, in one launch. The split fp8 GEMV then
reads the fp8 row and its scale (`fp8_gemv.fp8_gemv_split(x_scale=...)`) instead of every
program computing the op and the absmax over the whole row itself.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged.kernels import pdl
from paged.kernels.e4m3 import quantize_e4m3, token_scale
from paged.kernels.fused import rms_scaled, silu_mul

MAX_K = 16384  # the longest row (one read, kept in registers: 32 a thread at 16 warps)


@triton.jit
def _quantize_input_kernel(
    x_ptr, res_ptr, g_ptr, q_ptr, s_ptr, res_out_ptr, K, stride_x, eps, NORM: tl.constexpr,
    SILU_MUL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, BLOCK)
    ok = ks < K
    x = tl.load(x_ptr + row * stride_x + ks, mask=ok, other=0.0)
    if NORM:  # fused_add_rms_norm's arithmetic; the new residual written out
        s = (x.to(tl.float32) + tl.load(res_ptr + row * K + ks, mask=ok, other=0.0)
             .to(tl.float32)).to(x.dtype)  # fmt: skip
        tl.store(res_out_ptr + row * K + ks, s, mask=ok)
        h = s.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(h * h, 0) / K + eps)
        g = tl.load(g_ptr + ks, mask=ok, other=0.0)
        a = rms_scaled(h, rstd, g, x.dtype).to(x.dtype).to(tl.float32)
    elif SILU_MUL:
        up = tl.load(x_ptr + row * stride_x + K + ks, mask=ok, other=0.0)
        a = silu_mul(x, up).to(up.dtype).to(tl.float32)
    else:
        a = x.to(tl.float32)
    scale = token_scale(tl.max(tl.abs(a), 0))
    q = quantize_e4m3(a, scale)
    tl.store(q_ptr + row * K + ks, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + row, scale)


def quantize_input(
    x: torch.Tensor,
    norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    silu_mul: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(q float8_e4m3fn [M, K], scales float32 [M], new residual or None) of a linear's input:
    x itself; under `norm` (residual [M, K], g [K], eps) rms_norm(x + residual) * g, with
    x + residual returned in a new tensor (the inputs are not changed); under `silu_mul` x is
    [M, 2K] and the input silu_and_mul(x). K <= MAX_K."""
    m, k = x.shape
    if silu_mul:
        assert norm is None
        k //= 2
    assert k <= MAX_K and x.stride(1) == 1
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, dtype=torch.float32, device=x.device)
    res_out = torch.empty(m, k, dtype=x.dtype, device=x.device) if norm is not None else None
    res, g, eps = norm if norm is not None else (x, x, 0.0)
    if norm is not None:
        assert res.shape == x.shape and res.is_contiguous() and g.shape == (k,)
    if m:
        block = max(16, triton.next_power_of_2(k))
        _quantize_input_kernel[(m,)](
            x, res, g, q, s, res_out if res_out is not None else q, k, x.stride(0), eps,
            NORM=norm is not None, SILU_MUL=silu_mul, BLOCK=block,
            num_warps=4 if block <= 2048 else 8 if block <= 8192 else 16, **pdl.launch(),
        )  # fmt: skip
    return q, s, res_out


@triton.jit
def _silu_mul_absmax_kernel(x_ptr, out_ptr, amax_ptr, K, stride_x, P, BLOCK: tl.constexpr,
                            PDL: tl.constexpr):  # fmt: skip
    pdl.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    ks = p * BLOCK + tl.arange(0, BLOCK)
    ok = ks < K
    gate = tl.load(x_ptr + row * stride_x + ks, mask=ok, other=0.0)
    up = tl.load(x_ptr + row * stride_x + K + ks, mask=ok, other=0.0)
    a = silu_mul(gate, up).to(up.dtype)
    tl.store(out_ptr + row * K + ks, a, mask=ok)
    tl.store(amax_ptr + row * P + p, tl.max(tl.abs(a.to(tl.float32)), 0))


def silu_mul_absmax(x: torch.Tensor, block: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """(silu_and_mul(x) [M, K], float32 [M, P]: the absmax of each `block` columns of it) for
    x [M, 2K]: the activation before a down projection computed once by many programs, the
    token's scale left to the GEMV (the max of P numbers, `fp8_gemv_split(x_amax=...)`)."""
    m, k = x.shape[0], x.shape[1] // 2
    assert x.stride(1) == 1
    p = triton.cdiv(k, block)
    out = torch.empty(m, k, dtype=x.dtype, device=x.device)
    amax = torch.empty(m, p, dtype=torch.float32, device=x.device)
    if m:
        _silu_mul_absmax_kernel[(m, p)](x, out, amax, k, x.stride(0), p, BLOCK=block, num_warps=4,
                                        **pdl.launch())  # fmt: skip
    return out, amax
