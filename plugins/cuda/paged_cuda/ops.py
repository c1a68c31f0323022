"""Fused Triton ops replacing the torch defaults of ``paged.model.ops``."""

from __future__ import annotations

from collections.abc import Callable

import torch


def _rotary_prepare(positions: torch.Tensor, cos_sin_cache: torch.Tensor, dtype: torch.dtype):
    return positions, cos_sin_cache  # the kernel gathers per token itself


def _rotary_embedding(positions, q: torch.Tensor, k: torch.Tensor, rope):
    from paged.kernels import rotary_embedding

    pos, cache = rope
    return rotary_embedding(pos, q, k, cache, q.shape[-1])


def fused_ops() -> dict[str, Callable]:
    from paged import kernels

    return {
        "rms_norm": kernels.rms_norm,
        "fused_add_rms_norm": kernels.fused_add_rms_norm,
        "rotary_prepare": _rotary_prepare,
        "rotary_embedding": _rotary_embedding,
        "silu_and_mul": kernels.silu_and_mul,
    }
