"""Linear layers with weights that oneDNN reordered once, at load, into its blocked layout.

bfloat16/float16 only: a plain `F.linear` re-reads the row-major weight at every step, which
oneDNN handles at a fraction of the memory bandwidth for the skinny matrices of decoding
(measured in bench/results/cpu.md). float32 keeps `F.linear`, HF transformers' own path, so
float32 output stays token-identical to it. `--no-cpu-packed-weights` (LLM(cpu_packed_weights=
False), fallback PAGED_CPU_PACKED_WEIGHTS=0) turns this off: CpuPlatform.prepare_model decides.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from paged.quantization import QuantLinear, QuantMethod

log = logging.getLogger("paged")


def packing_available(dtype: torch.dtype) -> bool:
    """oneDNN's packed linears for `dtype` on this CPU (torch's oneDNN needs AVX-512 BW, VL
    and DQ, or AVX-NE-CONVERT, for bf16, and its own set for fp16: without them the reorder
    raises)."""
    if not (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    ):
        return False
    supported = {
        torch.bfloat16: getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None),
        torch.float16: getattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", None),
    }.get(dtype)
    return supported is not None and bool(supported())


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
    many were replaced. No-op for float32 or without oneDNN."""
    if dtype not in (torch.bfloat16, torch.float16) or not packing_available(dtype):
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


# ---- GGUF block weights (Q4_0 / Q4_1 / Q8_0 / K-quants) with 8-bit activations ---------
def gguf_blocks_available() -> bool:
    from paged_cpu.native import kernels

    native = kernels()
    return native is not None and native.q8_linear_native()


class GgufBlocksMethod(QuantMethod):
    """The quantized-linear method of a GGUF's Q4_0/Q4_1/Q8_0/K-quant blocks on the CPU: each
    block of 32 weights is code * d + m (Q6_K: each half of 16 its own d and m), each block of
    32 inputs is quantized to int8 with its own scale, and the block's dot products are exact
    integer arithmetic (AVX-512 VNNI), as llama.cpp computes them. The tensors come from the
    file at `prepare_model`, not from the safetensors loader (no `convert`)."""

    name = "gguf-blocks"
    from_checkpoint = True

    def __init__(self, groups: int, scales_dtype: torch.dtype, pairs: int = 1) -> None:
        from paged_cpu.native import kernels

        self.native = kernels()
        # pack_blocks' choices: code bytes, scales' dtype, (d, m) pairs a block (2: halves)
        self.groups, self.scales_dtype, self.pairs = groups, scales_dtype, pairs

    def create_weights(self, layer: QuantLinear) -> None:
        n, k = layer.out_features, layer.in_features
        layer.add("codes", (n // 16, k // 32, self.groups, 16, 4), torch.uint8)
        layer.add("scales", (n // 16, k // 32, 2 * self.pairs, 16), self.scales_dtype)

    def apply(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = self.native.q8_linear(
            x.reshape(-1, layer.in_features), layer.codes, layer.scales, layer.bias
        )
        return y.view(*shape[:-1], layer.out_features)


class GgufBlockLinear(QuantLinear):
    """A linear layer computed from the GGUF file's own blocks (GgufBlocksMethod). About
    1.3-1.5x the bf16 matmul rate at 64 rows and 3x at one row (bench/kernels_cpu.py)."""

    def __init__(
        self, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bias: torch.Tensor | None
    ) -> None:
        n, k = codes.shape
        packed, scales = pack_blocks(codes, d, m)
        method = GgufBlocksMethod(packed.shape[2], scales.dtype, scales.shape[2] // 2)
        super().__init__(k, n, bias is not None, method)
        with torch.no_grad():
            self.codes.copy_(packed)
            self.scales.copy_(scales)
            if bias is not None:
                self.bias.copy_(bias.detach().float())


def pack_blocks(
    codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] uint8 codes, [N, K/32] or [N, K/16] d and m -> the kernel's layout: codes
    [N/16, K/32, 8, 16, 4] (one 64-byte load = 4 consecutive k of 16 output columns), or
    [N/16, K/32, 4, 16, 4] when every code fits 4 bits (group g in the low nibble, g + 4 in
    the high one: half the bytes to read per step); scales [N/16, K/32, 2, 16] (d, m), or for
    groups of 16 [N/16, K/32, 4, 16] (d of each half, then m of each), float16 when that holds
    d and m exactly (a GGUF's scales are float16), else float32."""
    n, k = codes.shape
    pairs = d.shape[1] * 32 // k  # (d, m) pairs a block of 32
    if pairs not in (1, 2) or d.shape[1] * 32 != pairs * k:
        raise ValueError(f"GGUF blocks: {d.shape[1]} groups of a row of {k} (want K/32, K/16)")
    packed = codes.view(n // 16, 16, k // 32, 8, 4).permute(0, 2, 3, 1, 4)
    if int(codes.max()) < 16:
        packed = packed[:, :, :4] | (packed[:, :, 4:] << 4)
    dm = torch.stack((d, m), 1).view(n // 16, 16, 2, k // 32, pairs)
    dm = dm.permute(0, 3, 2, 4, 1).reshape(n // 16, k // 32, 2 * pairs, 16).float()
    half = dm.half()
    if torch.equal(half.float(), dm):
        dm = half
    return packed.contiguous(), dm.contiguous()


def gguf_block_linear(
    mod: nn.Module, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor, device: torch.device
) -> GgufBlockLinear | None:
    """A BlockLayerFactory (paged.quantization.gguf): the blocks of a bf16 linear layer (or a
    tied output head: its embedding's) whose whole weight they give, computed by the C++
    kernels with 8-bit activations; None (dense) for other layers or rows not a multiple of
    16."""
    from paged.model.llama import TiedHead

    if not isinstance(mod, (nn.Linear, TiedHead)):  # not a layer already quantized
        return None
    if codes.shape != mod.weight.shape or codes.shape[0] % 16:
        return None
    return GgufBlockLinear(codes, d, m, getattr(mod, "bias", None))
