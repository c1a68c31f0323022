"""Linear layers with weights that oneDNN reordered once, at load, into its blocked layout.

bfloat16/float16 only: a plain `F.linear` re-reads the row-major weight at every step, which
oneDNN handles at a fraction of the memory bandwidth for the skinny matrices of decoding
(measured in bench/results/cpu.md). float32 keeps `F.linear`, HF transformers' own path, so
float32 output stays token-identical to it. Set PAGED_CPU_PACKED_WEIGHTS=0 to turn this off.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import torch
from torch import nn

log = logging.getLogger("paged")


def packing_available() -> bool:
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class PackedLinear(nn.Module):
    """y = x W^T + b through oneDNN with W pre-reordered (any batch size)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        w = weight.detach().contiguous()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, self.in_features)
        y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return y.view(*shape[:-1], self.out_features)


def pack_linears(model: nn.Module, dtype: torch.dtype) -> int:
    """Replace every linear layer (and a tied output head) by a PackedLinear; returns how
    many were replaced. No-op for float32, without oneDNN, or when switched off."""
    if dtype not in (torch.bfloat16, torch.float16) or not packing_available():
        return 0
    if os.environ.get("PAGED_CPU_PACKED_WEIGHTS", "1") == "0":
        return 0
    from paged.model.llama import TiedHead

    swaps = [
        (name, mod)
        for name, mod in model.named_modules()
        if type(mod) in (nn.Linear, TiedHead) and mod.weight.dtype == dtype
    ]
    for name, mod in swaps:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, PackedLinear(mod.weight, mod.bias))
    log.info("packed %d linear layers for oneDNN", len(swaps))
    return len(swaps)


# ---- 4-bit GGUF weights (Q4_0 / Q4_1) ---------------------------------------------------
INT4_MAX_ROWS = int(os.environ.get("PAGED_CPU_INT4_MAX_ROWS", "8"))


def int4_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(
        torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"
    )


class Int4DualLinear(nn.Module):
    """A linear layer kept twice: as the GGUF file's own 4-bit codes (groups of 32, one scale
    and one offset each), which small batches read at a quarter of the memory traffic, and as
    the dense reordered matrix that oneDNN runs fastest for larger batches."""

    def __init__(
        self, dense: nn.Module, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor
    ) -> None:
        super().__init__()
        self.dense = dense
        self.in_features, self.out_features = codes.shape[1], codes.shape[0]
        self.bias = getattr(dense, "bias", None)
        self.qweight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.int(), 1)
        # The kernel computes (code - 8) * scale + zero: scale d, zero m + 8 d.
        self.scales_zeros = torch.stack((d.t(), (m + 8 * d).t()), dim=-1).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, self.in_features)
        if x.shape[0] > INT4_MAX_ROWS or x.dtype != torch.bfloat16:
            return self.dense(x).view(*shape[:-1], self.out_features)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.qweight, 32, self.scales_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)


def use_gguf_int4(model: nn.Module, path: str, hf_config) -> int:
    """Give each linear layer whose every piece is Q4_0/Q4_1 in the GGUF file at `path` its
    4-bit codes (stacked q/k/v and gate/up rows concatenated). Returns how many."""
    from paged.model.gguf_loader import iter_gguf_q4

    if os.environ.get("PAGED_CPU_INT4", "1") == "0" or not int4_available():
        return 0
    quant = {
        name.removeprefix("model.").removesuffix(".weight"): arrays
        for name, *arrays in iter_gguf_q4(path, hf_config)
        if name.endswith(".weight")
    }
    pieces: dict[str, list[str]] = {}  # our module -> the HF modules stacked in it, in order
    for hf in quant:
        target = hf
        for frag, (stacked, _) in getattr(model, "stacked", {}).items():
            if hf.endswith("." + frag):
                target = hf[: -len(frag)] + stacked
        pieces.setdefault(target, []).append(hf)
    order = {frag: idx for frag, (_, idx) in getattr(model, "stacked", {}).items()}
    count = 0
    for target, hfs in pieces.items():
        try:
            mod = model.get_submodule(target)
        except AttributeError:
            continue
        hfs.sort(key=lambda h: order.get(h.rsplit(".", 1)[-1], 0))
        codes, d, m = (
            torch.from_numpy(np.concatenate([quant[h][i] for h in hfs])) for i in range(3)
        )
        if codes.shape != (mod.out_features, mod.in_features) or codes.shape[1] % 32:
            continue  # a stacked layer with a piece in another format: stays dense
        parent_name, _, attr = target.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, Int4DualLinear(mod, codes, d, m))
        count += 1
    log.info(
        "%d linear layers read their GGUF 4-bit codes for batches of <= %d rows",
        count,
        INT4_MAX_ROWS,
    )
    return count
