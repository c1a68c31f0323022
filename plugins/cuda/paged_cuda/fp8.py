"""FP8 linears on Hopper/Ada tensor cores through cuBLASLt (`torch._scaled_mm` with row-wise
scales): the `fp8_linear` op of the cuda platform where the device has fp8 (sm_89+).

Per-token activation scales from the portable Triton quantization kernel, per-channel weight
scales as `torch._scaled_mm`'s row-wise `scale_b`. Up to 4 rows (decode) take the portable
tensor-core GEMV, which quantizes the rows itself (one kernel instead of two; 1.5-1.8x
faster on an H200 at one row: bench/gemv_gpu.py). Block-scaled weights (fp8 checkpoints with
weight_block_size) and outputs other than bfloat16 (row-wise scaling's only output type) take
the portable Triton GEMM instead.
"""

from __future__ import annotations

import torch

from paged.kernels.fp8_gemm import fp8_linear as triton_fp8_linear
from paged.kernels.fp8_gemm import quantize_fp8_rows
from paged.kernels.gemv import DOT_MAX_ROWS


def scaled_mm_available() -> bool:
    return hasattr(torch, "_scaled_mm") and torch.cuda.get_device_capability() >= (8, 9)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    group_k: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    n, k = weight.shape
    rowwise = scale.shape[1] == 1 and x.dtype == torch.bfloat16 and n % 16 == 0 and k % 16 == 0
    if not rowwise or x.numel() <= DOT_MAX_ROWS * k:  # few rows: the Triton GEMV is faster
        return triton_fp8_linear(x, weight, scale, group_k, bias)
    shape = x.shape
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    q, s = quantize_fp8_rows(x2)
    # weight [N, K] row-major is the column-major [K, N] operand cuBLASLt wants
    y = torch._scaled_mm(q, weight.t(), scale_a=s, scale_b=scale.view(1, n),
                         out_dtype=torch.bfloat16)  # fmt: skip
    if bias is not None:
        y = y + bias
    return y.view(*shape[:-1], n)
