"""Weight-only int4 linear layers (AWQ / GPTQ checkpoints, repacked at load; a GGUF's Q4
blocks) and their 8-bit kin (a GGUF's Q8_0 blocks): the weight's codes are dequantized in
registers, (code - zero) * scale per group of input columns, rounded to the activation dtype
as the torch reference does, and multiplied. With mins (GGUF Q4_1: code * d + m) the kernels
are launched with enable_fp_fusion=False: a fused multiply-add would round once where the
reference rounds the product and the sum.

Codes are int32 [N, K/8] (column k: bits 4*(k%8) of word k//8; 8-bit codes: [N, K/4], bits
8*(k%4) of word k//4), scales float32 and zeros uint8 [N, K/group]: one output channel's codes
are contiguous. Below DEQUANT_MIN_ROWS rows (decode batches, batch 1 included):
`int4_gemm_split`, a split-K GEMM that dequantizes each weight tile once for the tensor cores,
for every group width (GGUF's groups of 32 load a scale, zero and min a group of the step).
More rows: the weight dequantized whole by `_dequant_kernel` (the reference's values), then the
platform's GEMM (F.linear), as vLLM does for AWQ batches; the dequantization reads half a byte
and writes two a weight. On an H100 (Llama-3.1-8B's layer x 32, bench/quant_gpu.py,
2026-12-06), split GEMM against dequantized + cuBLAS, ms a step (bf16 cuBLAS: 4.99 at one row,
5.58 at 128):

| rows | group 128 | GGUF Q4_1 (32, mins) | GGUF Q8_0 (32) |
|---|---|---|---|
| 1 | 4.01 / 12.38 | 4.92 / 16.83 | 5.35 / 16.16 |
| 16 | 3.97 / 12.40 | 4.74 / 16.87 | 5.37 / 16.16 (rows gathered: 7.09) |
| 32 | 5.27 / 12.41 | 6.33 / 16.89 | 5.82 / 16.20 |
| 64 | 6.40 / 12.44 | 7.81 / 16.89 | 7.23 / 16.20 |
| 128 | 11.26 / 12.79 | 13.35 / 17.23 | 12.79 / 16.54 |
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged.kernels.int4_gemm_split import Config, code_bits, int4_gemm_split

DEQUANT_MIN_ROWS = 129  # from here: the weight dequantized, then F.linear
TUNED_MAX_ROWS = 4  # Int4TunedGemm's config (timed at one row) serves decode batches up to this


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
    w = (q - z[:, None]) * s[:, None]  # code - zero exact (no int-to-float conversion)
    if HAS_MIN:  # GGUF Q4_1: code * d + m, two roundings (launched without FMA contraction)
        w += tl.load(mins_ptr + cols64 * G + g, mask=col_ok, other=0.0)[:, None]
    return w.to(dtype)


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
    config: Config | None = None,
) -> torch.Tensor:
    """The `int4_linear` op on the device (`bits` 8: `int8_linear`): x [..., K] -> [..., N] in
    x's dtype. `config`: the split GEMM's (None: its default for the shape)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    n = scales.shape[0]
    if group_k < 16 or group_k & (group_k - 1):
        raise ValueError(f"int{bits}: group of {group_k} columns is not a power of 2 >= 16")
    if x2.shape[0] >= DEQUANT_MIN_ROWS:
        w = dequantize(codes, scales, zeros, group_k, mins, bits, x.dtype)
        b = None if bias is None else bias.to(x.dtype)
        return torch.nn.functional.linear(x2, w, b).view(*shape[:-1], n)
    y = int4_gemm_split(x2, codes, scales, zeros, group_k, bias, mins, bits, config)
    return y.view(*shape[:-1], n)


class Int4TunedGemm:
    """An int4 QuantLinear's forward with its split GEMM on `config` for up to TUNED_MAX_ROWS
    rows (a measured choice at one row: the CUDA plugin's int4_select installs it per weight
    shape), the layer's own forward otherwise."""

    def __init__(self, mod: torch.nn.Module, config: Config) -> None:
        self.mod, self.config = mod, config

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        mod = self.mod
        if x.numel() > TUNED_MAX_ROWS * x.shape[-1]:
            return type(mod).forward(mod, x)
        return int4_linear(x, mod.codes, mod.scales, mod.zeros, mod.group_k, mod.bias,
                           getattr(mod, "mins", None), code_bits(mod), self.config)  # fmt: skip
