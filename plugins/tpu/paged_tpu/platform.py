"""The TPU platform: torch_xla on PJRT, bucketed static shapes compiled at start-up.

Probing never imports torch_xla (a 5 s import) nor opens the PJRT client: on a TPU host only
one process may own the chips, and `paged platforms` or the API server must not take them
from the engine process.
"""

from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import os
from functools import partial
from pathlib import Path

import torch

from paged.platform import Platform, PlatformOption

# torch_xla 2.9 `_internal/tpu.py`: Google's PCI vendor id and the ids of its TPU chips
# (v2/v3, v4, v5e, v6e, v5p and test parts, 7x); gVNIC shares the vendor id, so both count.
GOOGLE_PCI_VENDOR = "0x1ae0"
TPU_PCI_DEVICES = {"0x0027", "0x005e", "0x0063", "0x006f", "0x0056", "0x0062", "0x0076"}


def tpu_chips(root: str = "/sys/bus/pci/devices") -> int:
    """TPU chips attached through PCI (what torch_xla counts), read without torch_xla."""
    n = 0
    for vendor in glob.glob(f"{root}/*/vendor"):
        try:
            if Path(vendor).read_text().strip() != GOOGLE_PCI_VENDOR:
                continue
            device = (Path(vendor).parent / "device").read_text().strip()
        except OSError:
            continue
        n += device in TPU_PCI_DEVICES
    return n


def _minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def torch_xla_version() -> str | None:
    """The installed torch_xla's version ("" for a source build), None when it is absent."""
    if importlib.util.find_spec("torch_xla") is None:
        return None
    try:
        return importlib.metadata.version("torch_xla")
    except importlib.metadata.PackageNotFoundError:
        return ""


def xla_mismatch(xla: str, torch_version: str) -> str | None:
    """Why this torch_xla cannot load with this torch: each release pins a torch release."""
    if xla and _minor(xla) != _minor(torch_version):
        return f"torch_xla {xla} needs torch {_minor(xla)}.* (this is torch {torch_version})"
    return None


def pjrt_device() -> str:
    return os.environ.get("PJRT_DEVICE", "").split("_")[0].upper()


class TpuPlatform(Platform):
    name = "tpu"
    device_type = "xla"  # the step runner's device; see `device` for the runner's host side
    priority = 90
    dist_backend = "xla"  # torch.distributed backend registered by torch_xla (see dist.py)
    supported_dtypes = (torch.bfloat16, torch.float32)
    unsupported_features = frozenset({"dynamic_shapes"})  # one compiled program per bucket
    options = (
        PlatformOption(
            "tpu_attention",
            "attention: auto (the Pallas ragged paged kernel on TPU chips, else torch), "
            "pallas, torch (static-shape torch ops)",
            "auto",
            choices=("auto", "pallas", "torch"),
            env="PAGED_TPU_ATTENTION",
        ),
    )

    @classmethod
    def probe(cls) -> str | None:
        xla = torch_xla_version()
        if xla is None:
            return "torch_xla not installed (pip install paged[tpu])"
        mismatch = xla_mismatch(xla, torch.__version__)
        if mismatch:
            return mismatch
        dev = pjrt_device()
        if dev and dev != "TPU":
            return None  # XLA on another PJRT device, chosen by the user (CPU in tests)
        if not tpu_chips():
            return "no XLA device: no TPU chip found (PJRT_DEVICE=CPU runs XLA on the host)"
        return None

    @property
    def device(self) -> torch.device:
        # The core's ModelRunner keeps its side (packed inputs, the host copy of the lm_head,
        # logits, sampling) on the host; XlaStepRunner owns the XLA device and the KV cache.
        return torch.device("cpu")

    def _xla_memory(self) -> tuple[int, int] | None:
        import torch_xla
        import torch_xla.core.xla_model as xm

        try:
            info = xm.get_memory_info(torch_xla.device())
        except RuntimeError:  # XLA:CPU has no allocator stats
            return None
        limit = int(info["bytes_limit"])
        return limit - int(info["bytes_used"]), limit

    def memory(self) -> tuple[int, int]:
        mem = self._xla_memory()
        if mem is not None:
            return mem
        page = os.sysconf("SC_PAGE_SIZE")
        return page * os.sysconf("SC_AVPHYS_PAGES"), page * os.sysconf("SC_PHYS_PAGES")

    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16

    def kv_cache_budget(self, config) -> int:
        """Device memory under gpu_memory_utilization once the weights are on the device (the
        step runner moved them there); on XLA:CPU a host-friendly 1 GiB at most."""
        if config.kv_cache_memory is not None:
            return config.kv_cache_memory
        mem = self._xla_memory()
        if mem is None:
            free, _ = self.memory()
            return min(1 << 30, free // 8)
        free, total = mem
        return max(0, int(total * config.gpu_memory_utilization) - (total - free))

    def attention_backend(self):
        from paged_tpu.attention import TpuAttentionBackend

        return partial(TpuAttentionBackend, attention=self.option("tpu_attention"))

    def step_runner(self):
        from paged_tpu.step_runner import XlaStepRunner

        return XlaStepRunner

    def synchronize(self) -> None:
        import torch_xla

        torch_xla.sync(wait=True)

    def describe(self) -> dict[str, str]:
        import torch_xla
        import torch_xla.runtime as xr

        return {
            "pjrt_device": str(xr.device_type()),
            "devices": str(xr.global_runtime_device_count()),
            "tpu_chips": str(tpu_chips()),
            "torch_xla": torch_xla.__version__,
        }
