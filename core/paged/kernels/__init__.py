"""Portable Triton kernels shared by the GPU plugins (cuda, rocm, xpu).

Names are resolved lazily so that importing `paged.kernels` does not import triton.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "reshape_and_cache": "cache",
    "paged_attention_varlen": "attention",
    "paged_attention_decode": "decode",
    "decode_workspace": "decode",
    "choose_num_splits": "decode",
    "rms_norm": "fused",
    "fused_add_rms_norm": "fused",
    "rotary_embedding": "fused",
    "silu_and_mul": "fused",
    "fused_moe": "moe",
    "lora_shrink": "lora",
    "lora_expand": "lora",
    "apply_token_bitmask": "bitmask",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'paged.kernels' has no attribute {name!r}")
    return getattr(importlib.import_module(f"paged.kernels.{_EXPORTS[name]}"), name)
