"""Weight-only int4 linear layers (AWQ / GPTQ checkpoints, repacked at load; a GGUF's Q4
blocks) and their 8-bit kin (a GGUF's Q8_0 blocks): the weight's codes are dequantized in
registers, (code - zero) * scale per group of input columns, rounded to the activation dtype
as the torch reference does, and multiplied. With mins (GGUF Q4_1: code * d + m) the kernels
are launched with enable_fp_fusion=False: a fused multiply-add would round once where the
reference rounds the product and the sum.

Codes are int32 [N, K/8] (column k: bits 4*(k%8) of word k//8; 8-bit codes: [N, K/4], bits
8*(k%4) of word k//4), scales float32 and zeros uint8 [N, K/group]: one output channel's codes
are contiguous, so a GEMV program streams its rows, one word split into its codes in
registers; a K step stays inside one group (one scale and zero per column). Few rows
(decode): `_int4_gemv`, a BLOCK_N x BLOCK_K tile of weights times the row's inputs, reduced
over K on the vector units. Up to DEQUANT_MIN_ROWS: `_int4_gemm`, a tiled GEMM that
dequantizes one weight tile per K step for tl.dot. More rows: the weight dequantized whole by
`_dequant_kernel` (the reference's values), then the platform's GEMM (F.linear), as vLLM does
for AWQ batches: measured on an H200 (Llama-3.1-8B's projections), the tiled GEMM took 20.5 ms
a step at 64 rows and 40.6 ms at 256 against cuBLAS's 4.0 / 6.3 ms in bf16, while the
dequantization reads half a byte and writes two a weight (about 4.5 ms a step at 4 TB/s).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GEMV_MAX_ROWS = 4
DEQUANT_MIN_ROWS = 16  # from here: the weight dequantized, then F.linear


@triton.jit
def _dequant_tile(codes_ptr, scales_ptr, zeros_ptr, mins_ptr, cols64, col_ok, k0, G, KW,
                  group_k, dtype: tl.constexpr, HAS_MIN: tl.constexpr, BITS: tl.constexpr,
                  BLOCK_K: tl.constexpr):  # fmt: skip
    """[BLOCK_N, BLOCK_K] weights (rounded to `dtype`) of columns `cols`, inputs
    k0 .. k0 + BLOCK_K: each int32 word (KW a row) loaded once and split into its 32 / BITS
    codes; the tile lies in one group (BLOCK_K divides group_k), so one scale and zero per
    column."""
    PER: tl.constexpr = 32 // BITS
    words_k = k0 // PER + tl.arange(0, BLOCK_K // PER)
    mask = col_ok[:, None] & (words_k < KW)[None, :]
    words = tl.load(codes_ptr + cols64[:, None] * KW + words_k[None, :], mask=mask, other=0)
    shifts = (tl.arange(0, PER) * BITS)[None, None, :]
    q = ((words[:, :, None] >> shifts) & ((1 << BITS) - 1)) | 0x4B000000
    q = tl.reshape(q, (q.shape[0], BLOCK_K)).to(tl.float32, bitcast=True)  # 2^23 + code
    g = k0 // group_k
    s = tl.load(scales_ptr + cols64 * G + g, mask=col_ok, other=0.0)
    z = tl.load(zeros_ptr + cols64 * G + g, mask=col_ok, other=0).to(tl.float32) + 8388608.0
    w = (q - z[:, None]) * s[:, None]  # code - zero exact, as in int4_gemv (no int-to-float)
    if HAS_MIN:  # GGUF Q4_1: code * d + m, two roundings (launched without FMA contraction)
        w += tl.load(mins_ptr + cols64 * G + g, mask=col_ok, other=0.0)[:, None]
    return w.to(dtype)


@triton.jit
def _int4_gemv(
    x_ptr, codes_ptr, scales_ptr, zeros_ptr, mins_ptr, bias_ptr, y_ptr,
    N, K, G, group_k, stride_x, stride_y,
    HAS_BIAS: tl.constexpr, HAS_MIN: tl.constexpr, BITS: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    cols64 = cols.to(tl.int64)
    KW = K * BITS // 32
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_x + ks, mask=ks < K, other=0.0).to(tl.float32)
        w = _dequant_tile(codes_ptr, scales_ptr, zeros_ptr, mins_ptr, cols64, col_ok, k0, G, KW,
                          group_k, y_ptr.dtype.element_ty, HAS_MIN, BITS, BLOCK_K)  # fmt: skip
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, acc.to(y_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _int4_gemm(
    x_ptr, codes_ptr, scales_ptr, zeros_ptr, mins_ptr, bias_ptr, y_ptr,
    M, N, K, G, group_k, stride_x, stride_y,
    HAS_BIAS: tl.constexpr, HAS_MIN: tl.constexpr, UPCAST: tl.constexpr, BITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    rows64, cols64 = rows.to(tl.int64), cols.to(tl.int64)
    KW = K * BITS // 32
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + rows64[:, None] * stride_x + ks[None, :],
                    mask=row_ok[:, None] & (ks < K)[None, :], other=0.0)  # fmt: skip
        w = tl.trans(_dequant_tile(codes_ptr, scales_ptr, zeros_ptr, mins_ptr, cols64, col_ok,
                                   k0, G, KW, group_k, y_ptr.dtype.element_ty, HAS_MIN, BITS,
                                   BLOCK_K))  # fmt: skip
        if UPCAST:  # float32, or the CPU interpreter (it multiplies bf16 storage as ints)
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows64[:, None] * stride_y + cols64[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])  # fmt: skip


@triton.jit
def _dequant_kernel(codes_ptr, scales_ptr, zeros_ptr, mins_ptr, w_ptr, N, K, G, group_k,
                    HAS_MIN: tl.constexpr, BITS: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):  # fmt: skip
    """w [N, K] in w's dtype: one [BLOCK_N, BLOCK_K] tile (inside one group) a program."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    cols64 = cols.to(tl.int64)
    k0 = tl.program_id(1) * BLOCK_K
    w = _dequant_tile(codes_ptr, scales_ptr, zeros_ptr, mins_ptr, cols64, col_ok, k0, G,
                      K * BITS // 32, group_k, w_ptr.dtype.element_ty, HAS_MIN, BITS,
                      BLOCK_K)  # fmt: skip
    ks = k0 + tl.arange(0, BLOCK_K)
    tl.store(w_ptr + cols64[:, None] * K + ks[None, :], w,
             mask=col_ok[:, None] & (ks < K)[None, :])  # fmt: skip


def dequantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_k: int,
    mins: torch.Tensor | None,
    bits: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The weight [N, K] in `dtype`: reference.dequantize_int4(...).to(dtype)'s values."""
    n, groups = scales.shape
    k = codes.shape[1] * 32 // bits
    w = torch.empty(n, k, dtype=dtype, device=codes.device)
    bn, bk = 32, min(group_k, 128)
    _dequant_kernel[(triton.cdiv(n, bn), triton.cdiv(k, bk))](
        codes, scales, zeros, mins if mins is not None else scales, w, n, k, groups, group_k,
        HAS_MIN=mins is not None, BITS=bits, BLOCK_N=bn, BLOCK_K=bk, num_warps=4,
        enable_fp_fusion=False,
    )  # fmt: skip
    return w


def int4_linear(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_k: int,
    bias: torch.Tensor | None = None,
    mins: torch.Tensor | None = None,
    bits: int = 4,
) -> torch.Tensor:
    """The `int4_linear` op on the device (`bits` 8: `int8_linear`): x [..., K] -> [..., N] in
    x's dtype."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, k = x2.shape
    n, groups = scales.shape
    if group_k < 16 or group_k & (group_k - 1):
        raise ValueError(f"int{bits}: group of {group_k} columns is not a power of 2 >= 16")
    if m >= DEQUANT_MIN_ROWS:
        w = dequantize(codes, scales, zeros, group_k, mins, bits, x.dtype)
        b = None if bias is None else bias.to(x.dtype)
        return torch.nn.functional.linear(x2, w, b).view(*shape[:-1], n)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y.view(*shape[:-1], n)
    b = bias if bias is not None else y
    mn = mins if mins is not None else scales
    if m <= GEMV_MAX_ROWS:
        bn, bk = 32, min(group_k, 128, max(16, triton.next_power_of_2(k)))
        _int4_gemv[(triton.cdiv(n, bn), m)](
            x2, codes, scales, zeros, mn, b, y, n, k, groups, group_k, x2.stride(0), y.stride(0),
            HAS_BIAS=bias is not None, HAS_MIN=mins is not None, BITS=bits, BLOCK_N=bn,
            BLOCK_K=bk, num_warps=4, enable_fp_fusion=mins is None,
        )  # fmt: skip
    else:
        bm = 16 if m <= 16 else 32 if m <= 32 else 64
        bn = 64 if m <= 64 else 128
        bk = min(group_k, 64, max(16, triton.next_power_of_2(k)))
        upcast = x.dtype == torch.float32 or x.device.type == "cpu"
        grid = (triton.cdiv(n, bn), triton.cdiv(m, bm))
        _int4_gemm[grid](
            x2, codes, scales, zeros, mn, b, y, m, n, k, groups, group_k, x2.stride(0),
            y.stride(0), HAS_BIAS=bias is not None, HAS_MIN=mins is not None, UPCAST=upcast,
            BITS=bits, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=4,
            enable_fp_fusion=mins is None,
        )  # fmt: skip
    return y.view(*shape[:-1], n)
