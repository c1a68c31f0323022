"""A GGUF's 4-bit tensors kept quantized on the device: Q4_0 / Q4_1 blocks of 32 as the int4
layout of the AWQ/GPTQ kernels (codes [N, K/8], a scale, zero and min per block: Q4_0 is
(code - 8) * d, Q4_1 code * d + m, the file's own arithmetic), computed by `int4_linear`.

The engine loads a GGUF's weights dequantized; a platform calls `use_gguf_int4` from
`prepare_model` to put these layers in place of the dense ones (the cuda plugin does). Q8_0
and other types stay dense."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import torch
from torch import nn

from paged.model import ops
from paged.quantization.base import QuantLinear, QuantMethod
from paged.quantization.reference import pack_int4

log = logging.getLogger("paged")
BLOCK = 32


class GgufInt4Method(QuantMethod):
    name = "gguf-int4"
    suffixes = frozenset()  # built from the file's blocks, not the weight loader

    def create_weights(self, layer: QuantLinear) -> None:
        n, k = layer.out_features, layer.in_features
        layer.group_k = BLOCK
        layer.add("codes", (n, k // 8), torch.int32)
        layer.add("scales", (n, k // BLOCK), torch.float32)
        layer.add("zeros", (n, k // BLOCK), torch.uint8)
        layer.add("mins", (n, k // BLOCK), torch.float32)

    def apply(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        return ops.get("int4_linear")(x, layer.codes, layer.scales, layer.zeros, BLOCK,
                                      layer.bias, layer.mins)  # fmt: skip


def int4_layer(
    codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bias: torch.Tensor | None
) -> QuantLinear | None:
    """The layer of one (maybe stacked) GGUF tensor in iter_gguf_blocks' form (weight =
    code * d + m), on d's device; None unless every code fits in 4 bits (Q4_0 / Q4_1)."""
    n, k = codes.shape
    if k % BLOCK or int(codes.max()) > 15:
        return None
    layer = QuantLinear(k, n, bias is not None, GgufInt4Method())
    q4_0 = torch.equal(m, -8.0 * d)  # Q4_0's m is -8 d exactly: keep its (code - 8) * d
    with torch.no_grad():
        layer.to(d.device)
        layer.codes.copy_(pack_int4(codes))
        layer.scales.copy_(d)
        layer.zeros.fill_(8 if q4_0 else 0)
        layer.mins.copy_(torch.zeros_like(m) if q4_0 else m)
        if bias is not None:
            layer.bias.data = bias.detach().clone()  # the model's dtype
    return layer


def gguf_linear_blocks(
    model: nn.Module,
    source,
    hf_config,
    want: Callable[[nn.Module], bool],
    tied_head: bool = False,
) -> Iterator[tuple[str, nn.Module, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(module path, module, codes, d, m) for each module of `model` that `want`s them and
    whose pieces are all block tensors of the GGUF model `source` (iter_weight_blocks' form:
    weight = code * d + m), stacked q/k/v and gate/up rows concatenated in stacking order.
    `tied_head`: the embedding's blocks are the output head's too."""
    from paged.model.loader import iter_weight_blocks

    quant = {}
    for name, *arrays in iter_weight_blocks(source, hf_config):
        name = name.removeprefix("model.").removesuffix(".weight")
        quant["lm_head" if tied_head and name == "embed_tokens" else name] = arrays
    stacked = getattr(model, "stacked", {})
    pieces: dict[str, list[str]] = {}  # our module -> the HF modules stacked in it, in order
    for hf in quant:
        target = hf
        for frag, (into, _) in stacked.items():
            if hf.endswith("." + frag):
                target = hf[: -len(frag)] + into
        pieces.setdefault(target, []).append(hf)
    order = {frag: idx for frag, (_, idx) in stacked.items()}
    for target, hfs in pieces.items():
        try:
            mod = model.get_submodule(target)
        except AttributeError:
            continue
        if not want(mod):
            continue
        hfs.sort(key=lambda h: order.get(h.rsplit(".", 1)[-1], 0))
        codes, d, m = (torch.cat([quant[h][i] for h in hfs]) for i in range(3))
        yield target, mod, codes, d, m


def replace_module(model: nn.Module, path: str, new: nn.Module) -> None:
    parent_name, _, attr = path.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)


def use_gguf_int4(model: nn.Module, source, hf_config) -> int:
    """Replace each dense linear layer of `model` whose every piece is a Q4_0/Q4_1 tensor of
    the GGUF model `source` by an int4 layer (stacked q/k/v and gate/up rows concatenated).
    Returns how many were replaced."""
    dev = next(model.parameters()).device
    count = 0
    # not the tied head, nor a layer already quantized
    for target, mod, codes, d, m in gguf_linear_blocks(
        model, source, hf_config, lambda mod: type(mod) is nn.Linear
    ):
        if codes.shape != mod.weight.shape:
            continue  # a stacked layer with a piece in another format
        layer = int4_layer(codes.to(dev), d.to(dev), m.to(dev), mod.bias)
        if layer is None:
            continue
        replace_module(model, target, layer)
        count += 1
    log.info("%d linear layers keep the GGUF's 4-bit blocks (int4 kernels)", count)
    return count
