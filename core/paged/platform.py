"""The Platform contract: one subclass per device kind, shipped by a plugin.

Classes are returned by ``paged_platforms()``; the engine instantiates the selected one.
Keep vendor imports inside methods so that probing and listing stay cheap.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from paged.config import EngineConfig
    from paged.model.attention import AttentionBackend
    from paged.quantization.gguf import BlockLayerFactory
    from paged.worker.step_runner import StepRunner

log = logging.getLogger("paged")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(frozen=True)
class PlatformOption:
    """A switch a platform declares in `Platform.options`: a flag of the engine commands
    (``--cpu-native/--no-cpu-native`` for a bool, ``--xpu-attention {auto,ipex,triton}`` for
    a str with choices), an argument of ``LLM(...)`` (``cpu_native=False``) and, when `env`
    names one, an environment variable read only when neither was given."""

    name: str  # the platform's name first: cpu_native, xpu_attention
    help: str
    default: bool | str  # its type is the option's type
    choices: tuple[str, ...] | None = None  # str options: the accepted values
    env: str | None = None  # the documented fallback, e.g. PAGED_CPU_NATIVE

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def check(self, value: Any) -> bool | str:
        """`value` as this option's type, or ValueError naming the option."""
        if isinstance(self.default, bool):
            if isinstance(value, bool):
                return value
            raise ValueError(f"platform option {self.name}: expected True or False, got {value!r}")
        if not isinstance(value, str) or (self.choices and value not in self.choices):
            choices = f"one of {', '.join(self.choices)}" if self.choices else "a string"
            raise ValueError(f"platform option {self.name}: expected {choices}, got {value!r}")
        return value

    def from_env(self) -> bool | str | None:
        """The fallback environment variable's value, parsed; None when unset or empty."""
        text = os.environ.get(self.env, "").strip().lower() if self.env else ""
        if not text:
            return None
        if isinstance(self.default, bool):
            if text in _TRUE + _FALSE:
                return text in _TRUE
            raise ValueError(f"{self.env}={os.environ[self.env]!r}: use 1 or 0 (or {self.flag})")
        if self.choices and text not in self.choices:
            raise ValueError(
                f"{self.env}={os.environ[self.env]!r}: use {', '.join(self.choices)} "
                f"(or {self.flag})"
            )
        return text


_ignored: set[tuple[str, str]] = set()  # other platforms' options already reported


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
    # --max-num-batched-tokens when not given.
    default_max_num_batched_tokens: ClassVar[int] = 2048
    # --max-num-seqs when not given.
    default_max_num_seqs: ClassVar[int] = 256
    # Kernels compile on first use (Triton): warm them up at start-up (paged.engine.warmup).
    kernel_warmup: ClassVar[bool] = False
    # Environment variables that choose which of this host's devices a process sees, the one
    # read first: replicas on one host get disjoint slices of the devices it lists (of 0..n-1
    # when none is set), each slice written to all of them (paged.engine.placement). Empty:
    # its replicas cannot be given devices of their own (the CPU).
    device_masks: ClassVar[tuple[str, ...]] = ()
    # What this platform cannot run, by name; a model class lists what it needs in its
    # `requires` (e.g. "dynamic_shapes": matmuls sized by data, as mixture-of-experts routing
    # does) and is refused at start-up on a platform lacking one (paged.model.registry).
    unsupported_features: ClassVar[frozenset[str]] = frozenset()

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

    def bind_device(self, local_rank: int) -> None:
        """Make device `local_rank` of this host the current one (one per worker process of a
        tensor/pipeline-parallel replica); nothing on the host CPU."""
        if self.device_type != "cpu":
            getattr(torch, self.device_type).set_device(local_rank)

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
        from paged.worker.step_runner import StepRunner

        return StepRunner

    def gguf_block_layer(self, config: EngineConfig) -> BlockLayerFactory | None:
        """Where this platform computes a GGUF's Q4/Q5/Q6/Q8 tensors from their blocks under
        `config`: the factory of its block layers (paged.quantization.gguf), which the model
        gets in place of its dense linears; those weights are then never dequantized. None
        (the default): every weight is loaded dequantized."""
        return None

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

    # ---- options ---------------------------------------------------------------------
    # Switches that change results or kernels, declared by the plugin; the engine passes the
    # ones set explicitly (EngineConfig.platform_options) to `configure` right after creating
    # the platform, and the plugin reads them with `option(name)`.
    options: ClassVar[tuple[PlatformOption, ...]] = ()

    def configure(self, values: Mapping[str, Any]) -> None:
        """The options set for this engine (flags, LLM arguments); other platforms' options
        are ignored (and reported once). Checks the fallback environment variables too."""
        mine = {o.name: o for o in self.options}
        self._option_values = {k: mine[k].check(v) for k, v in values.items() if k in mine}
        for name in sorted(set(values) - set(mine)):
            if (self.name, name) not in _ignored:
                _ignored.add((self.name, name))
                log.warning("platform option %s is not one of %s's: ignored", name, self.name)
        for o in self.options:
            self.option(o.name)  # a bad environment value fails at start-up

    def option(self, name: str) -> Any:
        """The value of option `name` for this engine: set explicitly (`configure`), else its
        environment variable, else its default."""
        opt = next((o for o in self.options if o.name == name), None)
        if opt is None:
            raise KeyError(f"platform {self.name} has no option {name!r}")
        values: dict[str, Any] = getattr(self, "_option_values", {})
        if name in values:
            return values[name]
        from_env = opt.from_env()
        return opt.default if from_env is None else from_env
