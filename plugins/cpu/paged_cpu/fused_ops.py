"""The CPU plugin's fused bfloat16 elementwise ops (csrc/elementwise.cpp) for paged.model.ops:
one pass per row instead of 5-10 torch ops. Other dtypes, and machines without the C++
kernels (or with them switched off: the cpu_native option), keep the torch defaults."""

from __future__ import annotations

from collections.abc import Callable

import torch

from paged.model import ops


def fused_ops(native_kernels: bool = True) -> dict[str, Callable]:
    from paged_cpu.native import kernels

    native = kernels(native_kernels)
    if native is None:
        return {}

    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or x.dim() != 2 or weight.dtype != x.dtype:
            return ops.rms_norm(x, weight, eps)
        return native.rms_norm_bf16(x, None, weight, eps)

    def fused_add_rms_norm(x, residual, weight, eps):
        if x.dtype != torch.bfloat16 or x.dim() != 2 or weight.dtype != x.dtype:
            return ops.fused_add_rms_norm(x, residual, weight, eps)
        return native.rms_norm_bf16(x, residual, weight, eps), residual  # residual += x

    def rotary_prepare(positions, cos_sin_cache, dtype):
        if dtype != torch.bfloat16:
            return ops.rotary_prepare(positions, cos_sin_cache, dtype)
        return cos_sin_cache  # the kernel reads each token's row itself

    def rotary_embedding(positions, q, k, rope):
        if q.dtype != torch.bfloat16:
            return ops.rotary_embedding(positions, q, k, rope)
        return tuple(native.rotary_bf16(positions, q, k, rope))

    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or x.dim() != 2:
            return ops.silu_and_mul(x)
        return native.silu_and_mul_bf16(x)

    return {
        "rms_norm": rms_norm,
        "fused_add_rms_norm": fused_add_rms_norm,
        "rotary_prepare": rotary_prepare,
        "rotary_embedding": rotary_embedding,
        "silu_and_mul": silu_and_mul,
    }
