"""FP8 linear layers: activations quantized per token to float8_e4m3fn, a GEMM on fp8
operands accumulating in float32, scaled by the token's scale and the weight's per-channel or
per-block scales (paged.quantization.reference.fp8_linear is the arithmetic).

For up to 4 rows (decode) `fp8_linear` is one kernel that quantizes the rows itself:
`gemv.fp8_gemv_dot` (tensor cores) with per-channel scales, `gemv.gemv` with block scales.
Else `quantize_fp8_rows` (one program per row: the row's absmax, then the scaled cast)
and `_fp8_gemm`: a BLOCK_M x BLOCK_N tile of the output per program on the tensor cores,
stepping over K by BLOCK_K. With per-channel weight
scales (one group) the scales multiply the finished accumulator; with block scales
(DeepSeek/Qwen FP8 checkpoints: 128 columns a group) each K step's partial product is scaled
by its group's weight scale.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged.kernels import gemv
from paged.kernels.e4m3 import quantize_e4m3, token_scale


@triton.jit
def _quant_rows(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, BLOCK: tl.constexpr,
                ONE_PASS: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    if ONE_PASS:  # the row fits one block: read once, kept in registers
        ks = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + ks, mask=ks < K, other=0.0).to(tl.float32)
        scale = token_scale(tl.max(tl.abs(x), axis=0))
        q = quantize_e4m3(x, scale)
        tl.store(q_ptr + row * stride_q + ks, q.to(q_ptr.dtype.element_ty), mask=ks < K)
    else:
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            ks = k0 + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + row * stride_x + ks, mask=ks < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = token_scale(tl.max(amax, axis=0))
        for k0 in range(0, K, BLOCK):
            ks = k0 + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + row * stride_x + ks, mask=ks < K, other=0.0).to(tl.float32)
            q = quantize_e4m3(x, scale)
            tl.store(q_ptr + row * stride_q + ks, q.to(q_ptr.dtype.element_ty), mask=ks < K)
    tl.store(s_ptr + row, scale)


_ONE_PASS_MAX = 16384  # longest row read once (32 fp32 registers a thread at 16 warps)


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8_e4m3fn [M, K], float32 scales [M, 1]), as the torch reference."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        one_pass = k <= _ONE_PASS_MAX
        block = max(16, triton.next_power_of_2(k)) if one_pass else 1024
        warps = min(16, max(4, block // 1024))
        _quant_rows[(m,)](x, q, s, k, x.stride(0), q.stride(0), BLOCK=block, ONE_PASS=one_pass,
                          num_warps=warps)  # fmt: skip
    return q, s


@triton.jit
def _fp8_gemm(
    a_ptr,  # [M, K] fp8
    as_ptr,  # [M] float32: per-token scales
    b_ptr,  # [N, K] fp8
    bs_ptr,  # [N, G] float32: per-group weight scales
    bias_ptr,
    c_ptr,  # [M, N]
    M,
    N,
    K,
    G,
    group_k,
    stride_am,
    stride_bn,
    stride_cm,
    HAS_BIAS: tl.constexpr,
    GROUPED: tl.constexpr,  # G > 1: scale each K step by its group's weight scale
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(0)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    rows64, cols64 = rows.to(tl.int64), cols.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(a_ptr + rows64[:, None] * stride_am + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        b = tl.load(b_ptr + cols64[None, :] * stride_bn + ks[:, None],
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # fmt: skip
        part = tl.dot(a, b, out_dtype=tl.float32)
        if GROUPED:
            bs = tl.load(bs_ptr + cols64 * G + k0 // group_k, mask=col_ok, other=0.0)
            acc += part * bs[None, :]
        else:
            acc += part
    a_s = tl.load(as_ptr + rows, mask=row_ok, other=0.0)
    acc = acc * a_s[:, None]
    if not GROUPED:
        acc = acc * tl.load(bs_ptr + cols64 * G, mask=col_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(c_ptr + rows64[:, None] * stride_cm + cols64[None, :],
             acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])  # fmt: skip


def _tiles(m: int, n: int, k: int, group_k: int, grouped: bool) -> tuple[int, int, int]:
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 128 else 128
    block_n = 32 if m <= 16 else 64 if m <= 64 else 128
    block_n = min(block_n, max(16, triton.next_power_of_2(n)))
    block_k = min(128, max(32, triton.next_power_of_2(k)))
    if grouped:  # one weight scale per K step
        block_k = min(block_k, group_k)
    return block_m, block_n, block_k


def fp8_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    group_k: int,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """fp8 a [M, K] with per-row scales [M, 1] times fp8 weight [N, K]^T with [N, G] scales."""
    m, k = a.shape
    n, groups = scale.shape
    c = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0:
        return c
    if m <= gemv.MAX_ROWS:
        return gemv.gemv(a, weight, scale, group_k, bias, x_scale=a_scale, out_dtype=out_dtype)
    grouped = groups > 1
    gemv.check_group(group_k, grouped)
    b = bias if bias is not None else c
    bm, bn, bk = _tiles(m, n, k, group_k, grouped)
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm))
    _fp8_gemm[grid](
        a, a_scale, weight, scale, b, c, m, n, k, groups,
        group_k, a.stride(0), weight.stride(0), c.stride(0),
        HAS_BIAS=bias is not None, GROUPED=grouped,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=4 if bm * bn <= 64 * 64 else 8,
    )  # fmt: skip
    return c


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    group_k: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The `fp8_linear` op on the device: x [..., K] -> [..., N] in x's dtype."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m <= gemv.DOT_MAX_ROWS and scale.shape[1] == 1:  # decode: one kernel, quantizing too
        y = gemv.fp8_gemv_dot(x2, weight, scale, bias)
    elif m <= gemv.MAX_ROWS:
        y = gemv.gemv(x2, weight, scale, group_k, bias, quantize_x=True)
    else:
        q, s = quantize_fp8_rows(x2)
        y = fp8_gemm(q, s, weight, scale, group_k, bias, x.dtype)
    return y.view(*shape[:-1], weight.shape[0])
