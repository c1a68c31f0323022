"""The CUDA platform: Triton paged attention, fused Triton ops, CUDA graphs for decode.

Memory, the profiled KV budget, dtypes, the attention backend and the fused ops come from
paged's `AcceleratorPlatform` through `torch.cuda`; this keeps the probe and the facts."""

from __future__ import annotations

import torch

from paged.accelerator import AcceleratorPlatform


class CudaPlatform(AcceleratorPlatform):
    name = "cuda"
    device_type = "cuda"
    priority = 100
    dist_backend = "nccl"

    @classmethod
    def probe(cls) -> str | None:
        if getattr(torch.version, "hip", None):
            return "this torch is a ROCm build (use the rocm platform)"
        if torch.version.cuda is None:
            return "this torch has no CUDA support (a CPU build)"
        if not torch.cuda.is_available():
            return "no CUDA device visible (driver missing or CUDA_VISIBLE_DEVICES empty)"
        try:
            import triton  # noqa: F401
        except ImportError:
            return "triton is not installed"
        return None

    def ops(self):
        """The Triton op table; fp8 linears through torch._scaled_mm where the GPU has fp8."""
        table = super().ops()
        from paged_cuda.fp8 import fp8_linear, scaled_mm_available

        if "fp8_linear" in table and scaled_mm_available():
            table["fp8_linear"] = fp8_linear
        return table

    def graph_runner(self):
        from paged_cuda.graphs import CudaGraphStepRunner

        return CudaGraphStepRunner

    def describe(self) -> dict[str, str]:
        import triton

        props = torch.cuda.get_device_properties(0)
        return {
            **super().describe(),
            "capability": f"{props.major}.{props.minor}",
            "cuda": str(torch.version.cuda),
            "triton": triton.__version__,
        }
