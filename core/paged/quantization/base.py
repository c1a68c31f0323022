"""The quantized-linear interface: a `QuantMethod` creates a linear layer's tensors, turns a
checkpoint's tensors into them, and computes the layer; `QuantLinear` is the module.

Models build their projections with `linear(in, out, bias)`: a plain `nn.Linear` normally,
a `QuantLinear` of the method active while the model is built (`building(method)`). Every
method keeps its tensors output-channel first ([N, ...]), so the models' loaders stack q/k/v
and gate/up rows and narrow tensor-parallel shards exactly as for dense weights (row-parallel
layers narrow the packed or grouped input dimension in proportion, see `narrow_in`).
The arithmetic is an op of `paged.model.ops` ("fp8_linear", "int4_linear"): the torch
reference by default, the platform's kernel where `Platform.ops()` supplies one.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import ClassVar

import torch
from torch import nn

# A decoder layer's tensor name after its index: self_attn.q_proj, mlp.experts.3.up_proj, ...
_LAYER_TAIL = re.compile(r"(?:^|\.)layers\.\d+\.(.+)$")


class QuantMethod:
    """One quantization format (from --quantization or the checkpoint's quantization_config).
    Subclasses implement the tensors (`create_weights`), the checkpoint conversion
    (`convert`), random weights (`dummy_weights`) and the product (`apply`)."""

    name: ClassVar[str] = ""
    # Checkpoint formats (AWQ, GPTQ, FP8 files) cannot be read into a model part that is not
    # a QuantLinear (MoE experts); a method quantizing float weights at load can leave them.
    from_checkpoint: ClassVar[bool] = True
    # The checkpoint tensor names (after the layer's) `convert` reads; others pass through.
    suffixes: ClassVar[frozenset[str]] = frozenset({"weight"})
    device: torch.device | None = None  # the model's device, set before `convert` runs

    def describe(self) -> str:
        return self.name

    def create_weights(self, layer: QuantLinear) -> None:
        """Register `layer`'s tensors (output channels first) as parameters."""
        raise NotImplementedError

    def convert(
        self, prefix: str, tensors: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor] | None:
        """The checkpoint tensors of one linear seen so far (suffix -> tensor) as this
        method's tensors (suffix -> tensor, in the checkpoint's full shape), or None while
        some are still to come. `tensors` may be consumed (popped)."""
        raise NotImplementedError

    def dummy_weights(self, layer: QuantLinear, gen: torch.Generator) -> None:
        """Random weights in place (--load-format dummy), on the layer's device."""
        raise NotImplementedError

    def apply(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class QuantLinear(nn.Module):
    """y = x W^T + b with W held as `method` holds it. `in_features`/`out_features` as in
    nn.Linear; the forward does not read a `.weight`, so wrappers (LoRA) add to its output."""

    def __init__(self, in_features: int, out_features: int, bias: bool, method: QuantMethod):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.method = method
        method.create_weights(self)
        self.keep_dtypes = {n: p.dtype for n, p in self.named_parameters(recurse=False)}
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def add(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Register a quantized tensor (its dtype survives `model.to(dtype)`)."""
        self.register_parameter(name, nn.Parameter(torch.empty(shape, dtype=dtype),
                                                   requires_grad=False))  # fmt: skip

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        for name, dtype in self.keep_dtypes.items():  # model.to(dtype) casts floats: undo it
            p = getattr(self, name)
            if p.dtype != dtype:
                p.data = p.data.to(dtype)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, method={self.method.describe()}")  # fmt: skip


_active: list[QuantMethod | None] = [None]


@contextmanager
def building(method: QuantMethod | None):
    """Models built inside quantize their projections with `method` (None: dense)."""
    _active.append(method)
    try:
        yield
    finally:
        _active.pop()


def linear(in_features: int, out_features: int, bias: bool = False) -> nn.Module:
    """A projection of a decoder layer: nn.Linear, or the active method's QuantLinear."""
    method = _active[-1]
    if method is None:
        return nn.Linear(in_features, out_features, bias=bias)
    return QuantLinear(in_features, out_features, bias, method)


def narrow_in(t: torch.Tensor, start: int, count: int, full: int) -> torch.Tensor:
    """Columns [start, start + count) of the `full` input columns of a row-parallel weight, or
    the matching slice of a quantized tensor whose dim 1 packs or groups them (int4 codes:
    8 a word; scales: one per group; a single column: per output channel, kept whole)."""
    cols = t.shape[1]
    if cols == full:
        return t.narrow(1, start, count)
    if cols == 1:
        return t
    per = -(-full // cols)
    if start % per or (count % per and start + count != full):
        raise ValueError(
            f"tensor parallel: a shard of {count} input columns does not split the "
            f"quantized tensor's groups of {per}; use fewer ranks"
        )
    return t.narrow(1, start // per, -(-count // per))


def quant_targets(model: nn.Module) -> set[str]:
    """The checkpoint names (after `layers.N.`) of the model's quantized linears, stacked
    ones under each of their parts' names (q_proj, ... for qkv_proj)."""
    tails: set[str] = set()
    stacked = getattr(model, "stacked", {})
    for name, mod in model.named_modules():
        if not isinstance(mod, QuantLinear):
            continue
        m = _LAYER_TAIL.search(name)
        if m is None:
            continue
        tail = m.group(1)
        tails.add(tail)
        head, _, last = tail.rpartition(".")
        for frag, (into, _) in stacked.items():
            if last == into:
                tails.add(f"{head}.{frag}" if head else frag)
    return tails


def convert_checkpoint(
    weights: Iterable[tuple[str, torch.Tensor]], method: QuantMethod, targets: set[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with those of each quantized linear (`targets`) converted by
    `method` (grouped per layer until complete); biases and other tensors pass through
    (a KV cache scale stored under k_proj, for instance)."""
    from paged.model.loader import ModelLoadError

    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        prefix, _, suffix = name.rpartition(".")
        m = _LAYER_TAIL.search(prefix)
        if m is None or m.group(1) not in targets or suffix not in method.suffixes:
            if suffix in method.suffixes and suffix != "weight":  # e.g. a quantized lm_head
                raise ModelLoadError(
                    f"quantization {method.name}: {name!r} belongs to a layer paged keeps in "
                    "the model dtype (only the decoder layers' projections are quantized)"
                )
            yield name, tensor
            continue
        group = pending.setdefault(prefix, {})
        group[suffix] = tensor
        out = method.convert(prefix, group)
        if out is None:
            continue
        del pending[prefix]
        for s, t in out.items():
            yield f"{prefix}.{s}", t
    if pending:
        prefix, group = next(iter(pending.items()))
        raise ModelLoadError(
            f"quantization {method.name}: incomplete tensors for {prefix!r} (found "
            f"{sorted(group)}) and {len(pending) - 1} more layers"
        )
