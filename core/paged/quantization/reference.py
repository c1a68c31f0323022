"""Torch reference arithmetic of the quantized linears: what every kernel computes.

The default ops of `paged.model.ops` ("fp8_linear", "int4_linear", "int8_linear") call these,
so CPU runs them; the Triton kernels of `paged.kernels` and a platform's own (e.g.
`torch._scaled_mm` in the cuda plugin) are tested against them.

Layouts (output channels first, so stacked and tensor-parallel shards narrow like dense
weights): fp8: weight float8_e4m3fn [N, K] with float32 scales [N, G] over groups of
`group_k` input columns (G = 1: per output channel). int4: codes int32 [N, K/8] (column k is
bits 4*(k%8) of word k//8), float32 scales and uint8 zeros [N, K/group_k]; the weight is
(code - zero) * scale, plus a float32 min per group where given (GGUF Q4_1). int8 (GGUF Q8_0
and 8-bit blocks): the same with unsigned 8-bit codes, codes int32 [N, K/4] (column k is bits
8*(k%4) of word k//4).
"""

from __future__ import annotations

import functools

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(float8_e4m3fn).max
_TINY = 1e-12  # floor of an all-zero row's scale


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row fp8: (q [R, C] float8_e4m3fn, scale [R, 1] float32) with q * scale ~ x."""
    xf = x.float()
    scale = (xf.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=_TINY)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def expand_groups(scale: torch.Tensor, group_k: int, k: int) -> torch.Tensor:
    """[N, G] per-group values -> [N, K] per column."""
    return scale.repeat_interleave(group_k, dim=1)[:, :k]


def _grouped(w: torch.Tensor, values: torch.Tensor, group_k: int, fn) -> torch.Tensor:
    """fn(w, per-column values) for w [N, K] and values [N, G] per group of group_k columns,
    on a [N, G, group_k] view where the groups tile K (no [N, K] copy of the values)."""
    n, k = w.shape
    g = values.shape[1]
    if g == 1:
        return fn(w, values)
    if g * group_k == k:
        return fn(w.view(n, g, group_k), values[:, :, None]).view(n, k)
    return fn(w, expand_groups(values, group_k, k))


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, group_k: int) -> torch.Tensor:
    """float32 [N, K] of an fp8 weight and its [N, G] scales."""
    return _grouped(weight.float(), scale.float(), group_k, torch.mul)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    group_k: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = fp8(x) @ W^T + b: x [..., K] quantized to fp8 per token (dynamic scale), the
    product accumulated in float32 and returned in x's dtype."""
    shape = x.shape
    q, xs = quantize_fp8_rows(x.reshape(-1, shape[-1]))
    y = (q.float() @ dequantize_fp8(weight, scale, group_k).t()) * xs
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*shape[:-1], weight.shape[0])


def unpack_int4(codes: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """int32 [N, K*bits/32] -> int32 codes [N, K] (column k from bits `bits`*(k%per) of word
    k//per, per = 32 / bits codes a word; bits 4 or 8)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=codes.device)
    return ((codes[..., None] >> shifts) & ((1 << bits) - 1)).flatten(-2)


def pack_int4(values: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """uint8/int codes [N, K] in 0 .. 2^bits - 1 -> int32 [N, K*bits/32] (the inverse of
    unpack_int4)."""
    n, k = values.shape
    v = values.to(torch.int64).view(n, k * bits // 32, 32 // bits)
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=values.device)
    packed = (v << shifts).sum(-1)
    return torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)


def dequantize_int4(
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_k: int,
    mins: torch.Tensor | None = None,
    bits: int = 4,
) -> torch.Tensor:
    """float32 [N, K]: (code - zero) * scale (+ min: GGUF Q4_1's offset) per group of
    `group_k` input columns."""
    q = _grouped(unpack_int4(codes, bits).float(), zeros.float(), group_k, torch.sub)
    w = _grouped(q, scales.float(), group_k, torch.mul)
    return w if mins is None else _grouped(w, mins.float(), group_k, torch.add)


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
    """y = x @ W^T + b with W dequantized to x's dtype (weight-only int4; `bits` 8: 8-bit
    codes, int32 words [N, K/4])."""
    w = dequantize_int4(codes, scales, zeros, group_k, mins, bits).to(x.dtype)
    return torch.nn.functional.linear(x, w, None if bias is None else bias.to(x.dtype))


int8_linear = functools.partial(int4_linear, bits=8)  # the int8_linear op (GGUF Q8_0 blocks)
