"""LoRALinear: a model's linear layer (whatever module sits there: nn.Linear, a packed or
quantized one) plus the LoRA of every device slot, stacked.

A stacked projection (qkv_proj: q, k, v; gate_up_proj: gate, up) has one slice per HF
projection: A of all slices side by side [slots, slices x R, in] and B of all slices stacked
[slots, out, R] (slice j's rows read the shrink's columns jR..(j+1)R): one shrink and one
expand per projection. R is --max-lora-rank; an adapter of lower rank fills the first r
rows/columns, the rest stay zero; B holds the adapter's scale (alpha / r) folded in.
"""

from __future__ import annotations

import torch
from torch import nn

from paged.lora.batch import LoRABatch
from paged.model import ops


class LoRALinear(nn.Module):
    def __init__(
        self,
        base: nn.Module,
        in_features: int,
        out_sizes: list[int],
        max_loras: int,
        rank: int,
        batch: LoRABatch,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.base = base
        self.rank = rank
        self.out_sizes = list(out_sizes)
        self.offsets = [sum(out_sizes[:j]) for j in range(len(out_sizes))]
        self.batch = batch
        kw = dict(dtype=dtype, device=device)
        # buffers, not parameters: no weight loader or dummy initialiser touches them
        self.register_buffer("lora_a", torch.zeros(max_loras, len(out_sizes) * rank,
                                                   in_features, **kw))  # fmt: skip
        self.register_buffer("lora_b", torch.zeros(max_loras, sum(out_sizes), rank, **kw))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.batch.empty:
            return y
        shape = y.shape
        x2, y2 = x.reshape(-1, x.shape[-1]), y.view(-1, shape[-1])
        xa = ops.get("lora_shrink")(x2, self.lora_a, self.batch)
        ops.get("lora_expand")(y2, xa, self.lora_b, self.out_sizes, self.batch)
        return y

    @torch.no_grad()
    def set_slot(self, slot: int, slices: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Load slot `slot`: {slice index: (A [r, in], B [out_j, r])}; slices not given stay
        zero (the adapter leaves that projection alone)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        for j, (a, b) in slices.items():
            r, off = a.shape[0], self.offsets[j]
            self.lora_a[slot, j * self.rank : j * self.rank + r].copy_(a)
            self.lora_b[slot, off : off + self.out_sizes[j], :r].copy_(b)
