"""The base of the GPU platforms: devices reached through a torch device module.

CUDA, ROCm (HIP answers through torch's "cuda" module) and Intel XPU expose the same API
under `torch.<name>`: `mem_get_info`, `memory_reserved`, `max_memory_allocated`,
`synchronize`, `empty_cache`, `reset_peak_memory_stats`, `get_device_properties`,
`is_bf16_supported`, and a graph API (`<Graph class>()`, `graph(g, pool=...)`,
`graph_pool_handle()`). `AcceleratorPlatform` implements memory, the profiled KV budget,
synchronisation, dtypes, the shared Triton attention backend and fused ops once, through the
module its `device_module` names (default: the device type); `AcceleratorGraphStepRunner`
captures decode steps with that module's graphs. A plugin keeps only what differs: name,
priority, probe, collectives, the graph class and its failure policy, its own attention
backend or tiles, and extra `describe()` facts.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from paged.platform import Platform
from paged.worker.graph_runner import GraphStepRunner

if TYPE_CHECKING:
    from paged.config import EngineConfig
    from paged.model.attention import AttentionBackend
    from paged.worker.step_runner import StepRunner


class AcceleratorPlatform(Platform):
    # The torch device module, `getattr(torch, name)`; None: `device_type`'s module.
    device_module: ClassVar[str | None] = None
    supported_dtypes = (torch.bfloat16, torch.float16, torch.float32)
    needs_profile_run = True
    pin_memory = True
    overlap_steps = True  # launch step N+1 before step N's tokens reach the host
    default_max_num_batched_tokens = 8192  # prompts in fewer steps: shorter time to first token
    # Wider decode batches use the tensor cores better (H200, 8B, 1000 x 256/256: 512 gave
    # 32.0k tok/s against 256's 29.9k and 768's 29.5k; bench/results/h200.md)
    default_max_num_seqs = 512
    kernel_warmup = True  # Triton kernels compile on first use

    @property
    def torch_module(self) -> ModuleType:
        """The torch device module this platform's device is driven through."""
        return getattr(torch, self.device_module or self.device_type)

    # Memory.

    def memory(self) -> tuple[int, int]:
        mod = self.torch_module
        if hasattr(mod, "mem_get_info"):
            return mod.mem_get_info()
        total = mod.get_device_properties(0).total_memory  # older modules: torch's view only
        return total - mod.memory_reserved(), total

    def kv_cache_budget(self, config: EngineConfig) -> int:
        """After the profiling forward: what is left under gpu_memory_utilization."""
        if config.kv_cache_memory is not None:
            return config.kv_cache_memory
        mod = self.torch_module
        free, total = self.memory()
        outside_torch = max(0, total - free - mod.memory_reserved())  # context, other processes
        peak = mod.max_memory_allocated()  # weights + activation peak of the profile
        return max(0, int(total * config.gpu_memory_utilization) - peak - outside_torch)

    def synchronize(self) -> None:
        self.torch_module.synchronize()

    def empty_cache(self) -> None:
        self.torch_module.empty_cache()

    def reset_peak_memory(self) -> None:
        mod = self.torch_module
        mod.synchronize()
        mod.reset_peak_memory_stats()

    # Dtypes and config.

    def device_name(self) -> str:
        """How the device is named in errors (ROCm: the gfx arch)."""
        return self.torch_module.get_device_properties(0).name

    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.torch_module.is_bf16_supported() else torch.float16

    def check_config(self, config: EngineConfig) -> None:
        super().check_config(config)
        if config.torch_dtype == torch.bfloat16 and not self.torch_module.is_bf16_supported():
            raise ValueError(
                f"dtype bfloat16 is not supported on {self.device_name()}: use float16"
            )
        if config.block_size < 16:
            raise ValueError("block_size: the attention kernels need at least 16 tokens a block")

    # Kernels and graphs.

    def attention_backend(self) -> type[AttentionBackend]:
        from paged.kernels.backend import TritonAttentionBackend

        return TritonAttentionBackend

    def ops(self) -> dict[str, Callable]:
        from paged.kernels.ops import triton_fused_ops

        return triton_fused_ops()

    def graph_runner(self) -> type[AcceleratorGraphStepRunner] | None:
        """The plugin's graph runner class (imported lazily); None: always eager."""
        return None

    def step_runner(self) -> type[StepRunner]:
        """The graph runner where this torch has its graph class, else eager."""
        runner = self.graph_runner()
        if runner is None or not hasattr(self.torch_module, runner.graph_class):
            return super().step_runner()
        return runner

    def describe(self) -> dict[str, str]:
        """The device facts every accelerator has; plugins add theirs."""
        mod = self.torch_module
        props = mod.get_device_properties(0)
        return {
            "device": props.name,
            "count": str(mod.device_count()),
            "memory_gib": f"{props.total_memory / 2**30:.1f}",
        }


class AcceleratorGraphStepRunner(GraphStepRunner):
    """`GraphStepRunner` on the graph API of an `AcceleratorPlatform`'s torch module:
    `<module>.<graph_class>()`, `<module>.graph(graph, pool=pool)`,
    `<module>.graph_pool_handle()`. A plugin sets `graph_class`, `graph_name` and its
    `eager_fallback` (and `max_capture_size` where it differs)."""

    graph_class: ClassVar[str] = ""  # e.g. "CUDAGraph", "XPUGraph"

    @property
    def api(self) -> ModuleType:
        return self.platform.torch_module

    def graphs_available(self) -> bool:
        return bool(self.graph_class) and hasattr(self.api, self.graph_class)

    def new_graph(self) -> Any:
        return getattr(self.api, self.graph_class)()

    def graph_capture(self, graph: Any, pool: Any):
        return self.api.graph(graph, pool=pool)

    def graph_pool(self) -> Any:
        return self.api.graph_pool_handle()
