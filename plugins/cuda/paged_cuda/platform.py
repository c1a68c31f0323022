"""The CUDA platform: Triton paged attention, fused Triton ops, CUDA graphs for decode."""

from __future__ import annotations

from collections.abc import Callable

import torch

from paged.platform import Platform


class CudaPlatform(Platform):
    name = "cuda"
    device_type = "cuda"
    priority = 100
    dist_backend = "nccl"
    supported_dtypes = (torch.bfloat16, torch.float16, torch.float32)
    needs_profile_run = True
    pin_memory = True
    overlap_steps = True  # launch step N+1 before step N's tokens reach the host

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

    def memory(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info()

    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16

    def check_config(self, config) -> None:
        super().check_config(config)
        if config.block_size < 16:
            raise ValueError("block_size: the Triton kernels need at least 16 tokens a block")

    def kv_cache_budget(self, config) -> int:
        """After the profiling forward: what is left under gpu_memory_utilization."""
        if config.kv_cache_memory is not None:
            return config.kv_cache_memory
        free, total = torch.cuda.mem_get_info()
        reserved = torch.cuda.memory_reserved()
        outside_torch = max(0, total - free - reserved)  # CUDA context, other processes
        peak = torch.cuda.max_memory_allocated()  # weights + activation peak of the profile
        return max(0, int(total * config.gpu_memory_utilization) - peak - outside_torch)

    def attention_backend(self):
        from paged.kernels.backend import TritonAttentionBackend

        return TritonAttentionBackend

    def step_runner(self):
        from paged_cuda.graphs import CudaGraphStepRunner

        return CudaGraphStepRunner

    def ops(self) -> dict[str, Callable]:
        from paged_cuda.ops import fused_ops

        return fused_ops()

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def reset_peak_memory(self) -> None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

    def describe(self) -> dict[str, str]:
        import triton

        props = torch.cuda.get_device_properties(0)
        return {
            "device": props.name,
            "count": str(torch.cuda.device_count()),
            "memory_gib": f"{props.total_memory / 2**30:.1f}",
            "capability": f"{props.major}.{props.minor}",
            "cuda": str(torch.version.cuda),
            "triton": triton.__version__,
        }
