"""A GGUF's block tensors kept quantized on the device: Q4_0 / Q4_1 / Q8_0 blocks of 32 (and
Q4_K / Q5_K sub-blocks of 32, Q6_K ones of 16) as the int4 layout of the AWQ/GPTQ kernels
(codes in int32 words, a scale, zero and maybe min per group: Q4_0 is (code - 8) * d, Q4_1
code * d + m, Q8_0 (code - 128) * d with code = q + 128, Q6_K (code - 32) * d: the file's own
arithmetic), computed by `int4_linear`, or `int8_linear` for 8-bit codes (the same kernels).

A platform offers its layers of these blocks through `Platform.gguf_block_layer` (the cuda
plugin: `int_block_layer`); the model runner reads the file's blocks first, keeps the dense
weights of the layers they cover on the meta device (`held_weights`, `weights_on_meta`),
dequantizes the rest, then puts the platform's layers in (`use_gguf_blocks`). Other types
(Q3_K, Q2_K, ...) stay dense."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn

from paged.model import ops
from paged.quantization.base import QuantLinear, QuantMethod
from paged.quantization.reference import pack_int4

if TYPE_CHECKING:
    from paged.model.loader import GgufBlocks

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


BlockLayerFactory = Callable[
    [nn.Module, torch.Tensor, torch.Tensor, torch.Tensor, torch.device], nn.Module | None
]
"""A platform's layer computing from a GGUF tensor's blocks: (the dense module it would
replace, codes, d, m, device) -> the layer, or None where it keeps that module dense."""


def int_block_layer(
    mod: nn.Module, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor, device: torch.device
) -> QuantLinear | None:
    """A BlockLayerFactory: block_layer on `device` in place of a plain linear layer whose
    whole weight the blocks give (the kernels of paged.kernels: the cuda plugin's)."""
    if type(mod) is not nn.Linear or codes.shape != mod.weight.shape:
        return None
    return block_layer(codes.to(device), d.to(device), m.to(device), mod.bias)


def gguf_block_arrays(source, hf_config) -> GgufBlocks:
    """{HF weight name: (codes, d, m)} of the GGUF model `source`'s block tensors
    (weight = code * d + m per group of K / d.shape[1] columns), each read when asked for."""
    from paged.model.loader import weight_blocks

    return weight_blocks(source, hf_config)


def block_pieces(
    model: nn.Module, quant: Mapping[str, tuple[torch.Tensor, ...]], tied_head: bool = False
) -> dict[str, list[str]]:
    """{module path of `model`: the HF weight names of `quant` stacked in it, in stacking
    order} for each module whose pieces include a block tensor. `tied_head`: the embedding's
    blocks are the output head's too."""
    stacked = getattr(model, "stacked", {})
    pieces: dict[str, list[str]] = {}
    for name in quant:
        hf = name.removeprefix("model.").removesuffix(".weight")
        target = "lm_head" if tied_head and hf == "embed_tokens" else hf
        for frag, (into, _) in stacked.items():
            if target.endswith("." + frag):
                target = target[: -len(frag)] + into
        pieces.setdefault(target, []).append(name)
    order = {frag: idx for frag, (_, idx) in stacked.items()}
    out = {}
    for target, names in pieces.items():
        try:
            model.get_submodule(target)
        except AttributeError:
            continue
        key = lambda n: order.get(n.removesuffix(".weight").rsplit(".", 1)[-1], 0)  # noqa: E731
        out[target] = sorted(names, key=key)
    return out


def held_weights(
    model: nn.Module, quant: GgufBlocks, pieces: dict[str, list[str]]
) -> dict[str, list[str]]:
    """The entries of `pieces` (block_pieces) whose module is a plain linear layer with its own
    weight and whose block tensors give all of that weight: those a platform's blocks may
    replace, whose dense weights need not be read (not a tied head: its weight is the
    embedding's; not a stacked layer with a piece in another format)."""
    out = {}
    for target, names in pieces.items():
        mod = model.get_submodule(target)
        w = mod._parameters.get("weight") if type(mod) is nn.Linear else None
        shapes = [quant.codes_shape(n) for n in names]  # from the store's header
        if w is not None and (sum(s[0] for s in shapes), shapes[0][1]) == tuple(w.shape):
            out[target] = names
    return out


@contextlib.contextmanager
def weights_on_meta(model: nn.Module, targets: Iterable[str]) -> Iterator[None]:
    """Inside, the weights of these modules are not the model's parameters: Module.to_empty
    leaves them on the meta device, allocated by no one until a block layer replaces the
    module (or, where the platform keeps it dense, the model runner reads it)."""
    held = {t: model.get_submodule(t)._parameters.pop("weight") for t in targets}
    try:
        yield
    finally:
        for t, w in held.items():
            model.get_submodule(t)._parameters["weight"] = w


def use_gguf_blocks(
    model: nn.Module,
    quant: Mapping[str, tuple[torch.Tensor, ...]],
    pieces: dict[str, list[str]],
    make: BlockLayerFactory,
    device: torch.device,
) -> int:
    """Replace each module of `pieces` (block_pieces) for which the platform's `make` builds a
    layer from its blocks in `quant` (gguf_block_arrays): stacked q/k/v and gate/up rows
    concatenated in stacking order (codes of fewer rows than the module: a piece in another
    format); pieces of wider groups (32 beside Q6_K's 16) have their d and m repeated to the
    narrowest group (the same weights). Returns how many were replaced."""
    count = 0
    for target, names in pieces.items():
        arrays = [quant[n] for n in names]  # read now (a lazy store), let go after the layer
        groups = max(a[1].shape[1] for a in arrays)  # the narrowest group's count
        codes = torch.cat([a[0] for a in arrays])
        d, m = (torch.cat([_widened(a[i], groups) for a in arrays]) for i in (1, 2))
        del arrays
        layer = make(model.get_submodule(target), codes, d, m, device)
        if layer is not None:
            replace_module(model, target, layer)
            count += 1
    log.info("%d linear layers compute from the GGUF's blocks", count)
    return count


def _widened(values: torch.Tensor, groups: int) -> torch.Tensor:
    """Per-group values [N, G] repeated to [N, groups] (G divides groups): each group's
    value over the narrower groups it spans."""
    reps = groups // values.shape[1]
    return values if reps == 1 else values.repeat_interleave(reps, dim=1)


def unreplaced(model: nn.Module, held: dict[str, list[str]]) -> dict[str, list[str]]:
    """The entries of `held` (held_weights) whose module is still the dense one, its weight
    on the meta device: the platform kept it dense, so its weights are to be read."""
    out = {}
    for target, names in held.items():
        w = model.get_submodule(target)._parameters.get("weight")
        if w is not None and w.is_meta:
            out[target] = names
    return out


def replace_module(model: nn.Module, path: str, new: nn.Module) -> None:
    parent_name, _, attr = path.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)
