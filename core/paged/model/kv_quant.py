"""The quantized KV cache (--kv-cache-dtype fp8) in torch: how K/V are quantized, the scales'
layout, and checkpoint scales.

A layer's K (and V) is stored as `fp8(clamp(x / scale, -max, max))` with one float32 scale per
KV head of this rank (`[num_kv_heads]`; a per-tensor scale is the same value for every head);
the value read back is `stored * scale`. The Triton kernels and the CPU backend quantize and
dequantize exactly this way; the torch functions here are their reference.

Scales come from the checkpoint where it carries them (compressed-tensors / fp8 checkpoints:
`model.layers.N.self_attn.k_scale` and `.v_scale`, older ones `.k_proj.output_scale` /
`.v_proj.output_scale` or one `.kv_scale` for both), per tensor or one per KV head; else 1.0.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator

import torch

log = logging.getLogger("paged")

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

# checkpoint name -> (layer index, which scales it sets)
_SCALE_NAME = re.compile(
    r"(?:.*\.)?layers\.(\d+)\.self_attn\.(k_scale|v_scale|kv_scale|k_proj\.output_scale|"
    r"v_proj\.output_scale|attn\.k_scale|attn\.v_scale)"
)  # any prefix: model., language_model.model., ...
_WHICH = {
    "k_scale": "k", "attn.k_scale": "k", "k_proj.output_scale": "k",
    "v_scale": "v", "attn.v_scale": "v", "v_proj.output_scale": "v",
    "kv_scale": "kv",
}  # fmt: skip


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x `[..., heads, head_dim]` -> `dtype`, one scale per head (saturating, round to
    nearest even)."""
    top = torch.finfo(dtype).max
    return (x.float() / scale[:, None].float()).clamp(-top, top).to(dtype)


def dequantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stored `[..., heads, head_dim]` values -> `dtype` (x * scale per head)."""
    return (x.float() * scale[:, None].float()).to(dtype)


class KVScales:
    """Per-layer K/V scales read from a checkpoint while its weights stream to the model."""

    def __init__(self) -> None:
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def take(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """`weights` without the KV cache scales, which are kept here."""
        for name, tensor in weights:
            m = _SCALE_NAME.fullmatch(name)
            if m is None:
                yield name, tensor
                continue
            layer, which = int(m.group(1)), _WHICH[m.group(2)]
            value = tensor.detach().float().reshape(-1).cpu()
            if "k" in which:
                self.k[layer] = value
            if "v" in which:
                self.v[layer] = value

    def __bool__(self) -> bool:
        return bool(self.k or self.v)

    def for_layer(
        self, layer: int, kv_heads: int, kv_start: int, total_kv_heads: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 `[kv_heads]` (k, v) scales of this rank's heads [kv_start, +kv_heads) of
        `layer`: 1.0 where the checkpoint has none; per-tensor scales broadcast."""
        out = []
        for table, what in ((self.k, "k_scale"), (self.v, "v_scale")):
            value = table.get(layer)
            if value is None:
                out.append(torch.ones(kv_heads))
            elif value.numel() == 1:
                out.append(value.expand(kv_heads).clone())
            elif value.numel() == total_kv_heads:
                out.append(value[kv_start : kv_start + kv_heads].clone())
            else:
                raise ValueError(
                    f"layer {layer} {what}: {value.numel()} values; expected one per tensor or "
                    f"one per KV head ({total_kv_heads})"
                )
            if not bool((out[-1] > 0).all() and out[-1].isfinite().all()):
                raise ValueError(f"layer {layer} {what}: scales must be positive and finite")
        return out[0], out[1]
