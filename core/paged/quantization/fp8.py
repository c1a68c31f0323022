"""FP8 weights (float8_e4m3fn) with dynamic per-token fp8 activations.

Three sources, one layout (weight [N, K] fp8, float32 scales [N, G] over groups of `group_k`
input columns): a float checkpoint quantized at load (`--quantization fp8`: one scale per
output channel, absmax / 448); transformers' "fp8" quantization_config (block-wise
`weight_scale_inv`, e.g. [128, 128] blocks: each block's scale repeated over its rows); and
compressed-tensors' float-quantized layout (`weight_scale` per channel or per tensor). A
static `input_scale` is not used: activations are always scaled per token at run time, which
is never coarser. Float weights of target layers in an fp8 checkpoint (its ignore lists) are
quantized at load.
"""

from __future__ import annotations

import torch

from paged.model import ops
from paged.quantization.base import QuantLinear, QuantMethod
from paged.quantization.reference import FP8, quantize_fp8_rows


class Fp8Method(QuantMethod):
    name = "fp8"
    suffixes = frozenset({"weight", "weight_scale", "weight_scale_inv", "input_scale"})

    def __init__(self, block: tuple[int, int] | None = None, source: str | None = None):
        """`block`: (rows, columns) of a checkpoint's block scales; None: per channel.
        `source`: the checkpoint format ("fp8", "compressed-tensors"); None: quantized at
        load from float weights."""
        self.block = block
        self.source = source
        self.device: torch.device | None = None  # where float weights are quantized at load
        self.from_checkpoint = source is not None
        if block is not None and (block[1] < 16 or block[1] & (block[1] - 1)):
            raise ValueError(f"quantization fp8: weight_block_size {list(block)} is not supported "
                             "(columns per block: a power of 2 >= 16)")  # fmt: skip

    def describe(self) -> str:
        scales = f"{self.block[0]}x{self.block[1]} blocks" if self.block else "per channel"
        return f"fp8 ({self.source or 'quantized at load'}, {scales})"

    def _groups(self, k: int) -> tuple[int, int]:
        """(group_k, G) for a layer of k input columns."""
        if self.block is None:
            return k, 1
        return self.block[1], -(-k // self.block[1])

    def create_weights(self, layer: QuantLinear) -> None:
        n, k = layer.out_features, layer.in_features
        layer.group_k, groups = self._groups(k)
        layer.add("weight", (n, k), FP8)
        layer.add("weight_scale", (n, groups), torch.float32)

    def _quantize(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.device is not None:  # the model's device: much faster than the host for 8B
            w = w.to(self.device)
        q, s = quantize_fp8_rows(w)
        return {"weight": q, "weight_scale": s.expand(-1, self._groups(w.shape[1])[1])}

    def convert(
        self, prefix: str, tensors: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor] | None:
        input_scale = tensors.pop("input_scale", None)  # static: per-token scales are used
        if input_scale is not None and input_scale.numel() != 1:
            raise ValueError(f"{prefix}.input_scale: expected one value, got shape "
                             f"{tuple(input_scale.shape)}")  # fmt: skip
        if not tensors:
            return {}
        w = tensors.get("weight")
        if w is None:
            return None
        if w.dtype != FP8:
            if not w.is_floating_point():
                raise ValueError(f"{prefix}.weight: dtype {w.dtype} is not a float or fp8")
            return self._quantize(w)
        scale = tensors.get("weight_scale_inv", tensors.get("weight_scale"))
        if scale is None:
            return None
        return {"weight": w, "weight_scale": self._scales(prefix, scale.float(), w.shape)}

    def _scales(self, prefix: str, scale: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """A checkpoint's per-tensor, per-channel or block scales as [N, G]."""
        n, k = shape
        groups = self._groups(k)[1]
        if scale.numel() == 1:
            return scale.reshape(1, 1).expand(n, groups)
        if scale.dim() == 1 or scale.shape[-1] == 1:
            if scale.numel() == n:
                return scale.reshape(n, 1).expand(n, groups)
        elif self.block is not None:
            rows = -(-n // self.block[0])
            if tuple(scale.shape) == (rows, groups):
                return scale.repeat_interleave(self.block[0], dim=0)[:n]
        raise ValueError(f"{prefix}: weight scale of shape {tuple(scale.shape)} does not fit a "
                         f"weight of {tuple(shape)} ({self.describe()})")  # fmt: skip

    def dummy_weights(self, layer: QuantLinear, gen: torch.Generator) -> None:
        w = torch.empty(layer.weight.shape, device=layer.weight.device)
        w.normal_(0.0, 0.02, generator=gen)
        for name, t in self._quantize(w).items():
            getattr(layer, name).copy_(t)

    def apply(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        return ops.get("fp8_linear")(x, layer.weight, layer.weight_scale, layer.group_k,
                                     layer.bias)  # fmt: skip
