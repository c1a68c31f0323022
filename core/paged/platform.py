"""The Platform contract: one subclass per device kind, shipped by a plugin.

Classes are returned by ``paged_platforms()``; the engine instantiates the selected one.
Keep vendor imports inside methods so that probing and listing stay cheap.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from paged.config import EngineConfig
    from paged.model.attention import AttentionBackend
    from paged.step_runner import StepRunner


class Platform:
    name: ClassVar[str] = "base"
    device_type: ClassVar[str] = "cpu"  # torch device type
    priority: ClassVar[int] = 0  # higher wins when several are available
    dist_backend: ClassVar[str] = "gloo"
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32,)
    # Run one forward at the largest batch before sizing the KV cache (device memory).
    needs_profile_run: ClassVar[bool] = False
    # Stage per-step inputs in page-locked host memory (async copies to the device).
    pin_memory: ClassVar[bool] = False
    # Launch step N+1 while step N runs (devices that compute asynchronously to the host).
    overlap_steps: ClassVar[bool] = False

    @classmethod
    def probe(cls) -> str | None:
        """None when usable here, else a short reason (shown by ``paged platforms``)."""
        return "not implemented"

    @classmethod
    def is_available(cls) -> bool:
        return cls.probe() is None

    @property
    def device(self) -> torch.device:
        return torch.device(self.device_type)

    def memory(self) -> tuple[int, int]:
        """(free, total) bytes of device memory: the KV cache budget starts here."""
        raise NotImplementedError

    def default_dtype(self) -> torch.dtype:
        return self.supported_dtypes[0]

    def check_config(self, config: EngineConfig) -> None:
        """Adjust the config for this device or raise ValueError naming what is unsupported."""
        if config.torch_dtype not in self.supported_dtypes:
            names = ", ".join(str(d).removeprefix("torch.") for d in self.supported_dtypes)
            raise ValueError(f"dtype {config.dtype} is not supported on {self.name} ({names})")

    def kv_cache_budget(self, config: EngineConfig) -> int:
        """Bytes for the KV cache, called after the weights are loaded and profiled."""
        if config.kv_cache_memory is not None:
            return config.kv_cache_memory
        free, total = self.memory()
        used = total - free
        return max(0, int(total * config.gpu_memory_utilization) - used)

    def attention_backend(self) -> type[AttentionBackend]:
        raise NotImplementedError

    def step_runner(self) -> type[StepRunner]:
        """Eager by default; graph-capturing platforms return their own runner."""
        from paged.step_runner import StepRunner

        return StepRunner

    def prepare_model(self, model: torch.nn.Module, config: EngineConfig, source=None) -> None:
        """After the weights are loaded (from `source`, a ModelSource, None for dummy weights):
        reorder them, or read the checkpoint's quantized form, for this device's kernels."""

    def ops(self) -> dict[str, Callable]:
        """Optional fused ops overriding the torch defaults in ``paged.model.ops``."""
        return {}

    def synchronize(self) -> None:
        pass

    def reset_peak_memory(self) -> None:
        """Start of the profiling forward: forget the allocator's high-water mark."""

    def empty_cache(self) -> None:
        pass

    def describe(self) -> dict[str, str]:
        """Facts for ``paged env``: device names, driver and library versions."""
        return {}
