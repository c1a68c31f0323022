"""How a platform runs the model forward for one step: eagerly here; graph-capturing
platforms (CUDA/HIP graphs, XLA buckets) subclass it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from paged.model.attention import AttentionMetadata

if TYPE_CHECKING:
    from paged.config import EngineConfig
    from paged.platform import Platform


class StepRunner:
    def __init__(
        self, model: torch.nn.Module, config: EngineConfig, platform: Platform, backend
    ) -> None:
        self.model = model
        self.config = config
        self.platform = platform
        self.backend = backend

    def capture(self) -> None:
        """Compile or capture ahead of serving (no-op when eager)."""

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        return self.model(input_ids, positions, self.backend.plan(meta))
