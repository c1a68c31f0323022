"""Loading a model's quantized linears: checkpoint tensors converted on the way in, random
weights for --load-format dummy."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from paged.quantization.base import QuantLinear, QuantMethod, convert_checkpoint, quant_targets

log = logging.getLogger("paged")


def check_model(model: nn.Module, method: QuantMethod) -> None:
    """Refuse a checkpoint format for a model part it cannot be read into (MoE experts)."""
    from paged.model.moe import SparseMoE

    if any(isinstance(m, SparseMoE) for m in model.modules()):
        if method.from_checkpoint:
            raise ValueError(f"quantization {method.name}: quantized mixture-of-experts "
                             "checkpoints are not supported")  # fmt: skip
        log.info("quantization %s: the experts stay in the model dtype", method.name)
    count = sum(isinstance(m, QuantLinear) for m in model.modules())
    log.info("quantization: %d linear layers as %s", count, method.describe())


def quantized_weights(
    model: nn.Module, method: QuantMethod | None, weights: Iterable[tuple[str, torch.Tensor]]
) -> Iterable[tuple[str, torch.Tensor]]:
    """The checkpoint's (name, tensor) pairs for `model.load_weights`."""
    if method is None:
        return weights
    check_model(model, method)
    method.device = next(model.parameters()).device  # convert there (then copied in place)
    return convert_checkpoint(weights, method, quant_targets(model))


def init_dummy(model: nn.Module, gen: torch.Generator) -> Iterator[str]:
    """Random weights for the quantized linears; yields the parameter names it set."""
    for name, mod in model.named_modules():
        if isinstance(mod, QuantLinear):
            mod.method.dummy_weights(mod, gen)
            for pname, _ in mod.named_parameters(recurse=False):
                if pname != "bias":
                    yield f"{name}.{pname}"
