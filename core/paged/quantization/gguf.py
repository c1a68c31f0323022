"""A GGUF's block tensors kept quantized on the device: Q4_0 / Q4_1 / Q8_0 blocks of 32 (and
Q4_K / Q5_K sub-blocks of 32, Q6_K ones of 16) as the int4 layout of the AWQ/GPTQ kernels
(codes in int32 words, a scale, zero and maybe min per group: Q4_0 is (code - 8) * d, Q4_1
code * d + m, Q8_0 (code - 128) * d with code = q + 128, Q6_K (code - 32) * d: the file's own
arithmetic), computed by `int4_linear`, or `int8_linear` for 8-bit codes (the same kernels).

The engine loads a GGUF's weights dequantized; a platform calls `use_gguf_blocks` from
`prepare_model` to put these layers in place of the dense ones (the cuda plugin does). Other
types (Q3_K, Q2_K, ...) stay dense."""

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


class GgufIntMethod(QuantMethod):
    """A GGUF's blocks of `group` weights (32; 16: Q6_K, or a stack with a Q6_K piece) as
    `bits`-bit codes (4: Q4_0 / Q4_1 / Q4_K; 8: Q8_0 / Q5_K / Q6_K, or pieces of several
    stacked in one layer), with a float32 min per block where the file has one (Q4_1, Q4_K,
    Q5_K)."""

    suffixes = frozenset()  # built from the file's blocks, not the weight loader

    def __init__(self, bits: int = 4, with_mins: bool = True, group: int = BLOCK) -> None:
        self.bits, self.with_mins, self.group = bits, with_mins, group
        self.name = f"gguf-int{bits}"

    def create_weights(self, layer: QuantLinear) -> None:
        n, k, g = layer.out_features, layer.in_features, self.group
        layer.group_k = g
        layer.add("codes", (n, k * self.bits // 32), torch.int32)
        layer.add("scales", (n, k // g), torch.float32)
        layer.add("zeros", (n, k // g), torch.uint8)
        if self.with_mins:
            layer.add("mins", (n, k // g), torch.float32)

    def apply(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        return ops.get(f"int{self.bits}_linear")(x, layer.codes, layer.scales, layer.zeros,
                                                 layer.group_k, layer.bias,
                                                 getattr(layer, "mins", None))  # fmt: skip


def block_layer(
    codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bias: torch.Tensor | None
) -> QuantLinear | None:
    """The layer of one (maybe stacked) GGUF tensor in iter_gguf_blocks' form (weight =
    code * d + m per group of K / d.shape[1] columns, unsigned codes), on d's device: 4-bit
    codes where every code fits, else 8-bit. Where every group's m is -8 d (Q4_0), -128 d
    (Q8_0) or -32 d (Q6_K) the layer keeps the file's (code - zero) * d and no mins;
    otherwise code * d + m. None if the groups are not a power of 2 of at least 16 columns
    (the kernels' groups) that tile K."""
    n, k = codes.shape
    group = k // d.shape[1]
    if group < 16 or group & (group - 1) or group * d.shape[1] != k:
        return None
    bits = 4 if int(codes.max()) <= 15 else 8
    zero = next((z for z in (8, 128, 32) if torch.equal(m, -float(z) * d)), 0)
    method = GgufIntMethod(bits, with_mins=zero == 0, group=group)
    layer = QuantLinear(k, n, bias is not None, method)
    with torch.no_grad():
        layer.to(d.device)
        layer.codes.copy_(pack_int4(codes, bits))
        layer.scales.copy_(d)
        layer.zeros.fill_(zero)
        if zero == 0:
            layer.mins.copy_(m)
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
    weight = code * d + m per group of K / d.shape[1] columns), stacked q/k/v and gate/up rows
    concatenated in stacking order; pieces of wider groups (32 beside Q6_K's 16) have their
    d and m repeated to the narrowest group (the same weights). `tied_head`: the embedding's
    blocks are the output head's too."""
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
        groups = max(quant[h][1].shape[1] for h in hfs)  # the narrowest group's count
        codes = torch.cat([quant[h][0] for h in hfs])
        d, m = (torch.cat([_widened(quant[h][i], groups) for h in hfs]) for i in (1, 2))
        yield target, mod, codes, d, m


def _widened(values: torch.Tensor, groups: int) -> torch.Tensor:
    """Per-group values [N, G] repeated to [N, groups] (G divides groups): each group's
    value over the narrower groups it spans."""
    reps = groups // values.shape[1]
    return values if reps == 1 else values.repeat_interleave(reps, dim=1)


def replace_module(model: nn.Module, path: str, new: nn.Module) -> None:
    parent_name, _, attr = path.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)


def use_gguf_blocks(model: nn.Module, source, hf_config) -> int:
    """Replace each dense linear layer of `model` whose every piece is a Q4_0 / Q4_1 / Q8_0 /
    Q4_K / Q5_K / Q6_K tensor of the GGUF model `source` by a layer of its blocks (stacked
    q/k/v and gate/up rows concatenated). Returns how many were replaced."""
    dev = next(model.parameters()).device
    count = {4: 0, 8: 0}
    # not the tied head, nor a layer already quantized
    for target, mod, codes, d, m in gguf_linear_blocks(
        model, source, hf_config, lambda mod: type(mod) is nn.Linear
    ):
        if codes.shape != mod.weight.shape:
            continue  # a stacked layer with a piece in another format
        layer = block_layer(codes.to(dev), d.to(dev), m.to(dev), mod.bias)
        if layer is None:
            continue
        replace_module(model, target, layer)
        count[layer.method.bits] += 1
    log.info("linear layers keeping the GGUF's blocks: %d 4-bit, %d 8-bit", count[4], count[8])
    return count[4] + count[8]
