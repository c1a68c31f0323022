"""How a platform runs the model forward for one step: eagerly here; graph-capturing
platforms (CUDA/HIP graphs, XLA buckets) subclass it."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from paged.model.attention import AttentionMetadata, plan_groups

if TYPE_CHECKING:
    from paged.config import EngineConfig
    from paged.platform import Platform

# A step's logits and greedy token ids from its final hidden states (None on a rank that
# holds no logits: a tensor-parallel follower).
Tail = tuple[torch.Tensor | None, torch.Tensor | None]


def block_dim(backend) -> int:
    """The dimension of the backend's KV cache that indexes blocks."""
    one, two = backend.kv_cache_shape(1), backend.kv_cache_shape(2)
    return next(i for i, (a, b) in enumerate(zip(one, two)) if a != b)


@torch.inference_mode()
def copy_kv_blocks(model: torch.nn.Module, backend, copies: torch.Tensor) -> None:
    """Copy blocks copies[0] -> copies[1] in the caches of `model`'s layers (any backend's
    layout: the block dimension is found from its kv_cache_shape), once per cache tensor
    (KV-cache groups share them)."""
    dim, src, dst = block_dim(backend), copies[0], copies[1]
    caches = {id(layer.self_attn.kv_cache): layer.self_attn.kv_cache for layer in model.layers}
    for cache in caches.values():
        if cache is not None:
            if cache.dtype.itemsize == 1:  # fp8: index_copy_ has no float8 kernels; bytes do
                cache = cache.view(torch.uint8)
            cache.index_copy_(dim, dst, cache.index_select(dim, src))


class StepRunner:
    num_kv_groups = 1  # KV-cache groups: attention metadata views (set by the model runner)
    # The step's tail (the LM head and the greedy argmax), set by the model runner where a
    # graph may run it (one pipeline stage, no LoRA, speculation or aux outputs).
    tail: Callable[[torch.Tensor], Tail] | None = None
    # Set with it: the draw of requests that sample with temperature, top-k/top-p and min-p
    # alone (sampling.sampler.sample_rows: logits, greedy ids, params [4, N], sort -> ids).
    sampler: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor] | None = None

    def __init__(
        self, model: torch.nn.Module, config: EngineConfig, platform: Platform, backend
    ) -> None:
        self.model = model
        self.config = config
        self.platform = platform
        self.backend = backend

    def copy_blocks(self, copies: torch.Tensor) -> None:
        """copies [2, n] on the device: copy KV blocks (sources, destinations) in every layer's
        cache, before the step's forward (copy on write of blocks sequences shared)."""
        copy_kv_blocks(self.model, self.backend, copies)

    def capture(self) -> None:
        """Compile or capture ahead of serving (no-op when eager)."""

    def decode_logits(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> Tail | None:
        """(logits, greedy ids) of a decode step run with its tail in one graph; None here
        (eager: the caller runs forward, then the head)."""
        return None

    def decode_sample(self, n: int, params: list[tuple], sort: bool) -> torch.Tensor | None:
        """Token ids of the decode step whose tail decode_logits just ran, drawn by `sampler`
        in a captured graph from `params` (each row's, sampling.sampler.plain_rows); None
        here (the caller samples eagerly)."""
        return None

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        return self.model(input_ids, positions, plan_groups(self.backend, meta))
