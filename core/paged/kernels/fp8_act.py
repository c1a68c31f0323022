"""The op before a decode fp8 linear computed once, with what the linear's per-token scale
needs: the rows' absmax (`Fp8SplitGemv`'s rows "amax"). The split fp8 GEMV then takes the
max of a few numbers (`fp8_gemv.fp8_gemv_split(x_amax=...)`) instead of every program
computing the op and the absmax over the whole row itself.

Before QKV and gate/up the residual add and RMSNorm's kernel writes each row's absmax
(`fused.fused_add_rms_norm(amax=...)`: one program a row has the row anyway); before down,
`silu_mul_absmax` below: SiLU-and-mul by many programs, each writing its block's absmax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged.kernels import pdl
from paged.kernels.fused import silu_mul


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
