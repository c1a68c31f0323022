"""The fused Triton ops now live in the core (`paged.kernels.ops`), shared by every GPU
platform through `AcceleratorPlatform.ops()`; this name stays for existing importers."""

from paged.kernels.ops import triton_fused_ops as fused_ops

__all__ = ["fused_ops"]
