"""The fallback attention path: paged's `TritonAttentionBackend` over the portable Triton
kernels of `paged.kernels`, compiled by Triton's Intel GPU backend (pytorch-triton-xpu ships
with XPU builds of torch). Split-K decode for pure-decode steps (fixed splits and a
preallocated workspace under XPU graphs), the varlen kernel for steps with prefill chunks.
"""

from __future__ import annotations

from paged.kernels.backend import TritonAttentionBackend, TritonPlan

__all__ = ["TritonPlan", "XpuTritonAttentionBackend"]


class XpuTritonAttentionBackend(TritonAttentionBackend):
    name = "triton-xpu"
