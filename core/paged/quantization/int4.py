"""Weight-only int4 (AWQ and GPTQ checkpoints), repacked at load into one layout: codes int32
[N, K/8] (column k in bits 4*(k%8) of word k//8), float32 scales and uint8 zero points
[N, K/group]; the weight is (code - zero) * scale.

AWQ ("gemm" version): qweight int32 [K, N/8] with the 8 columns of a word interleaved
(nibble i holds column 8c + [0, 2, 4, 6, 1, 3, 5, 7][i]), qzeros [K/g, N/8] packed the same
way, scales [K/g, N]. GPTQ (AutoGPTQ / optimum "gptq" format): qweight int32 [K/8, N] packed
along K (nibble j of row r is input 8r + j), qzeros [K/g, N/8] packed along N in order and
stored minus one (zero = stored + 1; "gptq_v2" checkpoints store the zero itself), scales
[K/g, N], g_idx [K] (only k // g: act-order checkpoints are refused).
"""

from __future__ import annotations

import torch

from paged.model import ops
from paged.quantization.base import QuantLinear, QuantMethod
from paged.quantization.reference import pack_int4

_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)
_AWQ_COLUMN_NIBBLE = [0, 4, 1, 5, 2, 6, 3, 7]  # column j of an AWQ word sits in nibble [j]


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> [R, C, 8]: nibble i of each word."""
    return (packed[..., None] >> _SHIFTS) & 0xF


def _unpack_columns(packed: torch.Tensor, awq: bool) -> torch.Tensor:
    """[R, C/8] words packing 8 columns each -> [R, C] values."""
    v = _nibbles(packed)
    if awq:
        v = v[..., _AWQ_COLUMN_NIBBLE]
    return v.flatten(-2)


class Int4Method(QuantMethod):
    """AWQ or GPTQ weights, 4 bits, `group_size` input columns per scale and zero."""

    suffixes = frozenset({"qweight", "qzeros", "scales", "g_idx", "weight"})

    def __init__(self, name: str, group_size: int, zero_offset: int = 0) -> None:
        if group_size < 16 or group_size & (group_size - 1):
            raise ValueError(f"quantization {name}: group_size {group_size} is not supported "
                             "(a power of 2 >= 16, e.g. 128)")  # fmt: skip
        self.name = name
        self.group_size = group_size
        self.zero_offset = zero_offset  # GPTQ v1 stores zero - 1

    def describe(self) -> str:
        return f"{self.name} (int4, group {self.group_size})"

    def create_weights(self, layer: QuantLinear) -> None:
        n, k = layer.out_features, layer.in_features
        if k % 8:
            raise ValueError(f"quantization {self.name}: {k} input columns, not a multiple of 8")
        groups = -(-k // self.group_size)
        layer.group_k = self.group_size
        layer.add("codes", (n, k // 8), torch.int32)
        layer.add("scales", (n, groups), torch.float32)
        layer.add("zeros", (n, groups), torch.uint8)

    def convert(
        self, prefix: str, tensors: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor] | None:
        g_idx = tensors.pop("g_idx", None)
        if g_idx is not None:
            k = torch.arange(g_idx.numel(), device=g_idx.device)
            if not torch.equal(g_idx.long(), k // self.group_size):
                raise ValueError(f"{prefix}.g_idx: act-order (desc_act) GPTQ checkpoints are not "
                                 "supported (groups must be consecutive columns)")  # fmt: skip
        if not tensors:
            return {}
        if not {"qweight", "qzeros", "scales"} <= tensors.keys():
            if "weight" in tensors:
                raise ValueError(f"{prefix}: a float weight in a {self.name} checkpoint (layers "
                                 "left unquantized are not supported)")  # fmt: skip
            return None
        qweight, qzeros, scales = tensors["qweight"], tensors["qzeros"], tensors["scales"]
        if self.name == "awq":  # [K, N/8], columns interleaved
            codes = pack_int4(_unpack_columns(qweight, awq=True).t())
        else:  # [K/8, N] packed along K: transposed, already our nibble order
            codes = qweight.t().contiguous()
        zeros = _unpack_columns(qzeros, awq=self.name == "awq") + self.zero_offset
        n, k = codes.shape[0], codes.shape[1] * 8
        groups = -(-k // self.group_size)
        if tuple(scales.shape) != (groups, n) or tuple(zeros.shape) != (groups, n):
            raise ValueError(f"{prefix}: scales {tuple(scales.shape)} / qzeros "
                             f"{tuple(qzeros.shape)} do not fit a {n}x{k} weight in groups of "
                             f"{self.group_size}")  # fmt: skip
        return {"codes": codes, "scales": scales.float().t(), "zeros": zeros.to(torch.uint8).t()}

    def dummy_weights(self, layer: QuantLinear, gen: torch.Generator) -> None:
        dev = layer.codes.device
        n, kw = layer.codes.shape
        values = torch.randint(0, 16, (n, kw * 8), generator=gen, device=dev)
        layer.codes.copy_(pack_int4(values))
        layer.scales.uniform_(0.002, 0.006, generator=gen)  # weights of std ~0.02
        layer.zeros.fill_(8)

    def apply(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        return ops.get("int4_linear")(x, layer.codes, layer.scales, layer.zeros, layer.group_k,
                                      layer.bias)  # fmt: skip
