"""Weight-only int4 linear layers (AWQ / GPTQ checkpoints, repacked at load): the weight's
4-bit codes are dequantized in registers, (code - zero) * scale per group of input columns,
rounded to the activation dtype as the torch reference does, and multiplied.

Codes are int32 [N, K/8] (column k: bits 4*(k%8) of word k//8), scales float32 and zeros
uint8 [N, K/group]: one output channel's codes are contiguous, so a GEMV program streams its
rows. Few rows (decode): `_int4_gemv`, a BLOCK_N x BLOCK_K tile of weights times the row's
inputs, reduced over K on the vector units. More rows: `_int4_gemm`, a tiled GEMM that
dequantizes one [BLOCK_K, BLOCK_N] weight tile per K step for tl.dot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GEMV_MAX_ROWS = 4


@triton.jit
def _dequant_tile(codes_ptr, scales_ptr, zeros_ptr, cols64, col_ok, ks, k_ok, G, KW, group_k,
                  dtype: tl.constexpr):  # fmt: skip
    """[BLOCK_K, BLOCK_N] weights (rounded to `dtype`) of columns `cols`, inputs `ks`."""
    mask = k_ok[:, None] & col_ok[None, :]
    words = tl.load(codes_ptr + cols64[None, :] * KW + (ks // 8)[:, None], mask=mask, other=0)
    q = (words >> ((ks % 8) * 4)[:, None]) & 0xF
    g = ks // group_k
    s = tl.load(scales_ptr + cols64[None, :] * G + g[:, None], mask=mask, other=0.0)
    z = tl.load(zeros_ptr + cols64[None, :] * G + g[:, None], mask=mask, other=0)
    return ((q - z.to(tl.int32)).to(tl.float32) * s).to(dtype)


@triton.jit
def _int4_gemv(
    x_ptr, codes_ptr, scales_ptr, zeros_ptr, bias_ptr, y_ptr,
    N, K, G, group_k, stride_x, stride_y,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    cols64 = cols.to(tl.int64)
    KW = K // 8
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_ptr + row * stride_x + ks, mask=k_ok, other=0.0).to(tl.float32)
        w = _dequant_tile(codes_ptr, scales_ptr, zeros_ptr, cols64, col_ok, ks, k_ok, G, KW,
                          group_k, y_ptr.dtype.element_ty)  # fmt: skip
        acc += tl.sum(w.to(tl.float32) * x[:, None], axis=0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, acc.to(y_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _int4_gemm(
    x_ptr, codes_ptr, scales_ptr, zeros_ptr, bias_ptr, y_ptr,
    M, N, K, G, group_k, stride_x, stride_y,
    HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    rows64, cols64 = rows.to(tl.int64), cols.to(tl.int64)
    KW = K // 8
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(x_ptr + rows64[:, None] * stride_x + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        w = _dequant_tile(codes_ptr, scales_ptr, zeros_ptr, cols64, col_ok, ks, k_ok, G, KW,
                          group_k, y_ptr.dtype.element_ty)  # fmt: skip
        if UPCAST:  # float32, or the CPU interpreter (it multiplies bf16 storage as ints)
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows64[:, None] * stride_y + cols64[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])  # fmt: skip


def int4_linear(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_k: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The `int4_linear` op on the device: x [..., K] -> [..., N] in x's dtype."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, k = x2.shape
    n, groups = scales.shape
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y.view(*shape[:-1], n)
    if group_k % 8 or group_k & (group_k - 1):
        raise ValueError(f"int4: group of {group_k} columns is not a power of 2 >= 8")
    b = bias if bias is not None else y
    if m <= GEMV_MAX_ROWS:
        bn, bk = 64, min(group_k, 128, max(16, triton.next_power_of_2(k)))
        _int4_gemv[(triton.cdiv(n, bn), m)](
            x2, codes, scales, zeros, b, y, n, k, groups, group_k, x2.stride(0), y.stride(0),
            HAS_BIAS=bias is not None, BLOCK_N=bn, BLOCK_K=bk, num_warps=4,
        )  # fmt: skip
    else:
        bm = 16 if m <= 16 else 32 if m <= 32 else 64
        bn = 64 if m <= 64 else 128
        bk = min(group_k, 64, max(16, triton.next_power_of_2(k)))
        upcast = x.dtype == torch.float32 or x.device.type == "cpu"
        grid = (triton.cdiv(n, bn), triton.cdiv(m, bm))
        _int4_gemm[grid](
            x2, codes, scales, zeros, b, y, m, n, k, groups, group_k, x2.stride(0), y.stride(0),
            HAS_BIAS=bias is not None, UPCAST=upcast, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
            num_warps=4,
        )  # fmt: skip
    return y.view(*shape[:-1], n)
