"""Attention on the portable Triton kernels (`paged.kernels`), with AMD-sized tiles.

The backend is paged's `TritonAttentionBackend` (split-K decode for pure-decode steps, the
varlen kernel for steps with prefill chunks); Triton compiles the same kernels for HIP and
only the launch tiles differ (see `tiles.py`).
"""

from __future__ import annotations

import logging

import torch

from paged.kernels.backend import TritonAttentionBackend
from paged_rocm.tiles import Tiles, choose_tiles, device_limits, launch_kwargs

log = logging.getLogger("paged")


class RocmTritonAttentionBackend(TritonAttentionBackend):
    name = "triton-rocm"

    def launch_tiles(self) -> tuple[dict[str, int], dict[str, int]]:
        self.tiles = self.pick_tiles()
        if not self.tiles:
            return {}, {}
        from paged.kernels import paged_attention_decode, paged_attention_varlen

        return (
            launch_kwargs(paged_attention_decode, self.tiles.get("decode")),
            launch_kwargs(paged_attention_varlen, self.tiles.get("varlen")),
        )

    def pick_tiles(self) -> dict[str, Tiles]:
        """The place to tune per GPU: LDS size and wavefront width come from the device."""
        if self.device.type != "cuda":  # CPU tensors under the Triton interpreter
            return {}
        lds, warp = device_limits(self.device.index or 0)
        elem = torch.empty((), dtype=self.dtype).element_size()
        tiles = choose_tiles(self.head_dim, elem, lds, warp)
        from paged.kernels import paged_attention_decode

        applied = bool(launch_kwargs(paged_attention_decode, tiles["decode"]))
        log.info(
            "ROCm attention tiles (LDS %d KiB, wave%d): %s, %s",
            lds >> 10,
            warp,
            tiles,
            "applied" if applied else "not applied (these paged.kernels take no tile arguments)",
        )
        return tiles
