"""Fused Triton ops from `paged.kernels` (compiled by Triton's Intel GPU backend) replacing
the torch defaults of `paged.model.ops`; none without triton."""

from __future__ import annotations

from collections.abc import Callable
from importlib.util import find_spec

import torch


def _rotary_prepare(positions: torch.Tensor, cos_sin_cache: torch.Tensor, dtype: torch.dtype):
    return positions, cos_sin_cache  # the kernel gathers cos/sin per token itself


def _rotary_embedding(positions, q: torch.Tensor, k: torch.Tensor, rope):
    from paged.kernels import rotary_embedding

    pos, cache = rope
    return rotary_embedding(pos, q, k, cache, q.shape[-1])


def fused_ops() -> dict[str, Callable]:
    if find_spec("triton") is None:
        return {}
    from paged import kernels

    return {
        "rms_norm": kernels.rms_norm,
        "fused_add_rms_norm": kernels.fused_add_rms_norm,
        "rotary_prepare": _rotary_prepare,
        "rotary_embedding": _rotary_embedding,
        "silu_and_mul": kernels.silu_and_mul,
    }
