"""The ROCm platform: AMD GPUs through torch's HIP build (the `torch.cuda` API, device type
"cuda"), Triton paged attention with AMD-sized tiles, fused Triton ops, HIP graphs, RCCL.

Memory, the profiled KV budget, dtypes and the fused ops come from paged's
`AcceleratorPlatform` (through `torch.cuda`, which is HIP here); this keeps the probe, the
device masks, the tiled attention backend and the AMD facts."""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from importlib.util import find_spec

import torch

from paged.accelerator import AcceleratorPlatform

# Device masks a ROCm process honours, in torch's order of precedence (ROCR narrows first).
VISIBILITY_VARS = ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")


def visibility_hint(env: MutableMapping[str, str] = os.environ) -> str:
    """Why no device may be visible: an empty device mask, else the driver or permissions."""
    for var in VISIBILITY_VARS:
        if var in env and env[var].strip() in ("", "-1"):
            return f"{var}={env[var]!r} hides every device"
    if os.path.exists("/dev/kfd") and not os.access("/dev/kfd", os.R_OK | os.W_OK):
        return "/dev/kfd is not accessible (add the user to the render and video groups)"
    return "amdgpu driver or ROCm runtime missing, or every device masked"


def sync_visible_devices(env: MutableMapping[str, str] = os.environ) -> None:
    """Make HIP_VISIBLE_DEVICES the one mask: mirror it into CUDA_VISIBLE_DEVICES (read by
    child processes and CUDA-minded tools), refusing two masks that disagree."""
    hip = env.get("HIP_VISIBLE_DEVICES")
    if hip is None:
        return
    cuda = env.get("CUDA_VISIBLE_DEVICES")
    if cuda is not None and cuda != hip:
        raise ValueError(
            f"HIP_VISIBLE_DEVICES={hip!r} and CUDA_VISIBLE_DEVICES={cuda!r} disagree; "
            "set only HIP_VISIBLE_DEVICES on ROCm"
        )
    env["CUDA_VISIBLE_DEVICES"] = hip


class RocmPlatform(AcceleratorPlatform):
    name = "rocm"
    device_type = "cuda"  # HIP devices are torch's "cuda" device type (and module) on ROCm
    priority = 100  # a torch build is either CUDA or ROCm, so this never ties with cuda
    dist_backend = "nccl"  # RCCL, registered under the NCCL name in ROCm builds of torch
    # HIP's mask, else CUDA's (which HIP also honours); a replica's slice goes to both, so
    # sync_visible_devices finds them equal. ROCR_VISIBLE_DEVICES, when set, narrows first.
    device_masks = ("HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")

    @classmethod
    def probe(cls) -> str | None:
        if not getattr(torch.version, "hip", None):
            cuda = torch.version.cuda
            kind = f"a CUDA {cuda} build" if cuda else "a CPU build"
            return f"this torch is not a ROCm build (torch.version.hip is unset: {kind})"
        if not torch.cuda.is_available():
            return f"no AMD GPU visible ({visibility_hint()})"
        if find_spec("triton") is None:
            return "triton is not installed (ROCm wheels of torch ship pytorch-triton-rocm)"
        return None

    def device_name(self) -> str:
        return getattr(torch.cuda.get_device_properties(0), "gcnArchName", "this GPU")

    def check_config(self, config) -> None:
        super().check_config(config)
        sync_visible_devices()

    def attention_backend(self):
        from paged_rocm.attention import RocmTritonAttentionBackend

        return RocmTritonAttentionBackend

    def graph_runner(self):
        from paged_rocm.graphs import HipGraphStepRunner

        return HipGraphStepRunner

    def describe(self) -> dict[str, str]:
        from importlib.metadata import PackageNotFoundError, version

        from paged_rocm.tiles import device_limits

        props = torch.cuda.get_device_properties(0)
        lds, warp = device_limits(0)
        triton = "missing"
        for dist in ("pytorch-triton-rocm", "triton"):
            try:
                triton = f"{dist} {version(dist)}"
                break
            except PackageNotFoundError:
                pass
        masks = {v: os.environ[v] for v in VISIBILITY_VARS if v in os.environ}
        return {
            **super().describe(),
            "arch": getattr(props, "gcnArchName", "?"),
            "wavefront": str(warp),
            "lds_kib": str(lds >> 10),
            "hip": str(torch.version.hip),
            "triton": triton,
            "visible_devices": ", ".join(f"{k}={v}" for k, v in masks.items()) or "all",
        }
