"""Attention on the portable Triton kernels (`paged.kernels`), with AMD-sized tiles.

Split-K decode for pure-decode steps (graph-safe: fixed splits, a preallocated workspace),
the varlen kernel for steps with prefill chunks (causal over cached context plus new tokens).
Triton compiles the same kernels for HIP; only the launch tiles differ (see `tiles.py`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from paged.model.attention import AttentionBackend, AttentionMetadata
from paged_rocm.tiles import Tiles, choose_tiles, device_limits, launch_kwargs

log = logging.getLogger("paged")


@dataclass
class RocmPlan:
    decode_only: bool
    num_splits: int


class RocmTritonAttentionBackend(AttentionBackend):
    name = "triton-rocm"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.workspace: torch.Tensor | None = None
        self.tiles = self.pick_tiles()

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

    def ensure_workspace(self, max_batch: int) -> None:
        from paged.kernels import decode_workspace
        from paged.kernels.decode import MAX_SPLITS

        if self.workspace is None or self.workspace.shape[0] < max_batch:
            self.workspace = decode_workspace(
                max_batch, self.num_heads, self.head_dim, MAX_SPLITS, self.device
            )

    def plan(self, meta: AttentionMetadata, num_splits: int | None = None) -> AttentionMetadata:
        from paged.kernels import choose_num_splits

        decode_only = meta.num_decodes == meta.num_reqs
        if decode_only and num_splits is None:
            num_splits = choose_num_splits(meta.num_reqs, self.num_kv_heads, meta.max_seq_len)
        if decode_only and num_splits > 1:
            self.ensure_workspace(meta.num_reqs)
        meta.extra = RocmPlan(decode_only, num_splits or 1)
        return meta

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        from paged.kernels import paged_attention_decode, paged_attention_varlen, reshape_and_cache

        plan: RocmPlan = meta.extra
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if plan.decode_only:
            paged_attention_decode(
                q,
                k_cache,
                v_cache,
                out,
                meta.seq_lens,
                meta.block_tables,
                self.scale,
                meta.max_seq_len,
                plan.num_splits,
                self.workspace if plan.num_splits > 1 else None,
                **launch_kwargs(paged_attention_decode, self.tiles.get("decode")),
            )
        else:
            paged_attention_varlen(
                q,
                k_cache,
                v_cache,
                out,
                meta.query_start_loc,
                meta.seq_lens,
                meta.block_tables,
                self.scale,
                meta.max_query_len,
                meta.max_seq_len,
                **launch_kwargs(paged_attention_varlen, self.tiles.get("varlen")),
            )
        return out
