"""The XPU platform: Intel GPUs through `torch.xpu`; IPEX paged attention when usable, else
the portable Triton kernels; XPU graphs where this torch has them; XCCL (or oneCCL).

Memory, the profiled KV budget, dtypes, the fused ops and the graph-or-eager choice come from
paged's `AcceleratorPlatform` through `torch.xpu`; this keeps the probe, the collective
backend and the attention choice."""

from __future__ import annotations

import glob
import logging
import os
from importlib.util import find_spec

import torch

from paged.accelerator import AcceleratorPlatform
from paged.platform import PlatformOption

log = logging.getLogger("paged")
MASK_VARS = ("ZE_AFFINITY_MASK", "ONEAPI_DEVICE_SELECTOR")


def visibility_hint() -> str:
    for var in MASK_VARS:
        if var in os.environ and os.environ[var].strip() in ("", "-1"):
            return f"{var}={os.environ[var]!r} hides every device"
    nodes = glob.glob("/dev/dri/renderD*")
    if nodes and not any(os.access(n, os.R_OK | os.W_OK) for n in nodes):
        return "/dev/dri/renderD* is not accessible (add the user to the render group)"
    return "Level Zero GPU driver missing, or every device masked"


def choose_dist_backend() -> str:
    """The collective backend: XCCL when this torch has it built in (2.8+ XPU builds), else
    oneCCL's "ccl" where its bindings are installed (`import oneccl_bindings_for_pytorch`
    registers it before `init_process_group`), else "xccl" to fail there with torch's error."""
    import torch.distributed as dist

    if dist.is_available() and getattr(dist, "is_xccl_available", lambda: False)():
        return "xccl"
    if find_spec("oneccl_bindings_for_pytorch") is not None:
        return "ccl"
    return "xccl"


class XpuPlatform(AcceleratorPlatform):
    name = "xpu"
    device_type = "xpu"
    priority = 90  # below cuda/rocm (a torch build has one GPU backend), above cpu
    dist_backend = "xccl"
    device_masks = ("ZE_AFFINITY_MASK",)
    options = (
        PlatformOption(
            "xpu_attention",
            "attention kernels: auto (IPEX where it serves the dtype, else Triton), ipex "
            "(fail when it cannot), triton",
            "auto",
            choices=("auto", "ipex", "triton"),
            env="PAGED_XPU_ATTENTION",
        ),
    )

    def __init__(self) -> None:
        self.dist_backend = choose_dist_backend()
        self.attention: tuple[type, str] | None = None  # (class, why), set by check_config

    @classmethod
    def probe(cls) -> str | None:
        xpu = getattr(torch, "xpu", None)
        if xpu is None:
            return "this torch has no torch.xpu module"
        if not getattr(xpu, "_is_compiled", lambda: True)():
            return "this torch is not an XPU build (torch.xpu is compiled out)"
        if not xpu.is_available():
            return f"no Intel GPU visible ({visibility_hint()})"
        if find_spec("intel_extension_for_pytorch") is None and find_spec("triton") is None:
            return "no attention kernels: install pytorch-triton-xpu or intel-extension-for-pytorch"
        return None

    def check_config(self, config) -> None:
        super().check_config(config)
        from paged_xpu.attention import choose_attention

        choice = self.option("xpu_attention")
        self.attention = choose_attention(config.torch_dtype, choice)  # raises: no path
        log.info("XPU attention: %s", self.attention[1])

    def attention_backend(self):
        if self.attention is None:  # check_config not called: decide for the default dtype
            from paged_xpu.attention import choose_attention

            self.attention = choose_attention(self.default_dtype(), self.option("xpu_attention"))
        return self.attention[0]

    def graph_runner(self):  # eager where this torch has no torch.xpu.XPUGraph
        from paged_xpu.graphs import XpuGraphStepRunner

        return XpuGraphStepRunner

    def describe(self) -> dict[str, str]:
        from importlib.metadata import PackageNotFoundError, version

        props = torch.xpu.get_device_properties(0)
        facts = {
            **super().describe(),
            "driver": str(getattr(props, "driver_version", "?")),
            "xmx": str(getattr(props, "has_subgroup_matrix_multiply_accumulate", "?")),
            "graphs": str(hasattr(torch.xpu, "XPUGraph")),
            "dist_backend": self.dist_backend,
        }
        for dist in ("intel-extension-for-pytorch", "pytorch-triton-xpu"):
            try:
                facts[dist] = version(dist)
            except PackageNotFoundError:
                facts[dist] = "missing"
        if self.attention is not None:
            facts["attention"] = self.attention[1]
        return facts
