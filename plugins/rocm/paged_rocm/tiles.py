"""Launch tiles for the portable Triton kernels on AMD GPUs.

`paged.kernels` was tuned on an H200: 32-lane warps and 228 KiB of shared memory a SM. CDNA
GPUs run 64-lane wavefronts and have 64 KiB of LDS a CU (160 KiB on gfx950); the decode
kernel's 128-key K+V tile (64 KiB at head_dim 128, bf16) with three pipeline stages does not
fit there. This module picks smaller tiles from the device's own numbers.

The kernel wrappers take optional tile arguments (block_m / block_n / num_warps /
num_stages); `launch_kwargs` passes those a wrapper's signature accepts.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import cache

# The keyword names a tile-aware wrapper is expected to accept.
TILE_PARAMS = ("block_m", "block_n", "num_warps", "num_stages")


@dataclass(frozen=True)
class Tiles:
    block_n: int  # keys per K/V tile
    num_warps: int  # wavefronts a program (64 lanes each on CDNA, 32 on RDNA)
    num_stages: int  # software-pipeline depth
    block_m: int | None = None  # query rows a program (varlen kernel only)


def _pow2_floor(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


def choose_tiles(head_dim: int, elem_size: int, lds_bytes: int, warp_size: int) -> dict[str, Tiles]:
    """Tiles for the `decode` and `varlen` kernels on a device with `lds_bytes` of LDS.

    The pipelined K/V tiles get at most half the LDS (the Q tile, the online-softmax state and
    the compiler's scratch take the rest), two stages as AMD's stream pipeliner prefers.
    """
    from paged.kernels.head_dims import head_pad

    stages = 2
    per_key = 2 * head_pad(head_dim) * elem_size  # K and V bytes of one key (tile width)
    block_n = min(128, max(16, _pow2_floor(lds_bytes // 2 // (per_key * stages))))
    warps = 4 if warp_size >= 64 else 8  # 256 lanes a program either way
    block_m = 64 if lds_bytes >= 96 * 1024 else 32
    return {
        "decode": Tiles(block_n, warps, stages),
        "varlen": Tiles(min(block_n, 64), warps, stages, block_m=block_m),
    }


@cache
def _accepted(fn: Callable) -> frozenset[str]:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return frozenset()
    return frozenset(n for n in TILE_PARAMS if n in params)


def launch_kwargs(fn: Callable, tiles: Tiles | None) -> dict[str, int]:
    """The subset of `tiles` that the kernel wrapper `fn` accepts as keyword arguments."""
    if tiles is None:
        return {}
    ok = _accepted(fn)
    return {k: v for k, v in asdict(tiles).items() if k in ok and v is not None}


def device_limits(index: int = 0) -> tuple[int, int]:
    """(LDS bytes a workgroup, wavefront size) of a ROCm device; CDNA values when unknown."""
    import torch

    props = torch.cuda.get_device_properties(index)
    lds = getattr(props, "shared_memory_per_block", 0) or 64 * 1024
    warp = getattr(props, "warp_size", 0) or 64
    return int(lds), int(warp)
