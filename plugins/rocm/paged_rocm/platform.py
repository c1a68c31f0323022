"""The ROCm platform: AMD GPUs through torch's HIP build (the `torch.cuda` API, device type
"cuda"), Triton paged attention with AMD-sized tiles, fused Triton ops, HIP graphs, RCCL."""

from __future__ import annotations

import os
from collections.abc import Callable, MutableMapping
from importlib.util import find_spec

import torch

from paged.platform import Platform

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


class RocmPlatform(Platform):
    name = "rocm"
    device_type = "cuda"  # HIP devices are torch's "cuda" device type on ROCm builds
    priority = 100  # a torch build is either CUDA or ROCm, so this never ties with cuda
    dist_backend = "nccl"  # RCCL, registered under the NCCL name in ROCm builds of torch
    supported_dtypes = (torch.bfloat16, torch.float16, torch.float32)
    needs_profile_run = True
    pin_memory = True
    overlap_steps = True  # launch step N+1 before step N's tokens reach the host

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

    def memory(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info()

    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16

    def check_config(self, config) -> None:
        super().check_config(config)
        if config.torch_dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
            arch = getattr(torch.cuda.get_device_properties(0), "gcnArchName", "this GPU")
            raise ValueError(f"dtype bfloat16 is not supported on {arch}: use float16")
        if config.block_size < 16:
            raise ValueError("block_size: the Triton kernels need at least 16 tokens a block")
        sync_visible_devices()

    def kv_cache_budget(self, config) -> int:
        """After the profiling forward: what is left under gpu_memory_utilization."""
        if config.kv_cache_memory is not None:
            return config.kv_cache_memory
        free, total = torch.cuda.mem_get_info()
        reserved = torch.cuda.memory_reserved()
        outside_torch = max(0, total - free - reserved)  # HIP context, other processes
        peak = torch.cuda.max_memory_allocated()  # weights + activation peak of the profile
        return max(0, int(total * config.gpu_memory_utilization) - peak - outside_torch)

    def attention_backend(self):
        from paged_rocm.attention import RocmTritonAttentionBackend

        return RocmTritonAttentionBackend

    def step_runner(self):
        from paged_rocm.graphs import HipGraphStepRunner

        return HipGraphStepRunner

    def ops(self) -> dict[str, Callable]:
        from paged_rocm.ops import fused_ops

        return fused_ops()

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def reset_peak_memory(self) -> None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

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
            "device": props.name,
            "arch": getattr(props, "gcnArchName", "?"),
            "count": str(torch.cuda.device_count()),
            "memory_gib": f"{props.total_memory / 2**30:.1f}",
            "wavefront": str(warp),
            "lds_kib": str(lds >> 10),
            "hip": str(torch.version.hip),
            "triton": triton,
            "visible_devices": ", ".join(f"{k}={v}" for k, v in masks.items()) or "all",
        }
