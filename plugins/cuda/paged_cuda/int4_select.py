"""Measured config for int4 linears at one row (batch-1 decode of AWQ / GPTQ checkpoints and of
a GGUF's Q4 / Q8_0 blocks kept 4- / 8-bit on the GPU).

Those run paged's unsplit int4 GEMV (paged.kernels.int4_gemm): 32 outputs a program over the
whole of K, which leaves the memory mostly idle (177 GB/s on an H200 for Llama-3.1-8B's
projections). At start-up, for each int4 weight shape among the model's linears, the unsplit
kernel and the split-K int4 GEMV (paged.kernels.int4_gemv) under a few configurations are timed
at one row, each in a CUDA graph over every weight of that shape (so they come from HBM, as in
a decode step); a shape whose best split config beats the unsplit kernel by
gemv_select.MARGIN runs it for inputs of up to four rows (the unsplit kernel's range). A shape
is (n, k, group, with mins, code bits).
"""

from __future__ import annotations

import logging

import torch
import triton
from torch import nn

from paged.kernels.int4_gemm import int4_linear
from paged.kernels.int4_gemv import (
    Config,
    Int4SplitGemv,
    code_bits,
    int4_gemv_split,
    split_counters,
)
from paged_cuda.gemv_select import choose, graph_time, graph_time_or_inf, model_dtype

log = logging.getLogger("paged")

MAX_TILE_WORDS = 2048  # code words a program holds a step (16 registers a lane at 4 warps)
Shape = tuple[int, int, int, bool, int]  # (n, k, group, with mins, code bits)


def candidates(n: int, k: int, sms: int, bits: int = 4) -> list[Config]:
    """(BLOCK_N, BLOCK_K, SPLIT, warps) to try for an int4 (`bits` 8: int8) weight of n outputs
    and k inputs on a GPU of `sms` SMs: enough programs to fill the SMs one to sixteen times
    over, each slice of K at least one BLOCK_K step and none empty."""
    out = []
    for block_n in (8, 16, 32):
        blocks = triton.cdiv(n, block_n)
        for block_k in (256, 512) if bits == 4 else (128, 256):
            if block_n * block_k * bits // 32 > MAX_TILE_WORDS:
                continue
            for split in (1, 2, 4, 8):
                per = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
                if not sms <= blocks * split <= 16 * sms or per * (split - 1) >= k:
                    continue
                out.append((block_n, block_k, split, 4))
    return out


def int4_linears(model: nn.Module) -> dict[Shape, list[nn.Module]]:
    """The model's int4-family linears on the GPU (AWQ / GPTQ, GGUF Q4 / Q8_0), by Shape."""
    from paged.quantization.base import QuantLinear

    shapes: dict[Shape, list[nn.Module]] = {}
    for mod in model.modules():
        if not isinstance(mod, QuantLinear) or "forward" in vars(mod):
            continue
        codes = getattr(mod, "codes", None)
        if codes is None or not codes.is_cuda or codes.dtype != torch.int32:
            continue
        key = (codes.shape[0], mod.in_features, mod.group_k,
               getattr(mod, "mins", None) is not None, code_bits(mod))  # fmt: skip
        shapes.setdefault(key, []).append(mod)
    return shapes


def use_measured_int4_gemv(model: nn.Module) -> None:
    """Time and install the split int4 GEMV per weight shape where it beats the unsplit one."""
    shapes = int4_linears(model)
    if not shapes:
        return
    device = next(iter(shapes.values()))[0].codes.device
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    dtype = model_dtype(model)
    xs = {key[1]: torch.randn(1, key[1], device=device, dtype=dtype) for key in shapes}
    most = max((split_counters(key[0], c) for key in shapes
                for c in candidates(key[0], key[1], sms, key[4])), default=1)  # fmt: skip
    counters = torch.zeros(most, dtype=torch.int32, device=device)

    def args(mod: nn.Module) -> tuple:
        return mod.codes, mod.scales, mod.zeros, mod.group_k, mod.bias, getattr(mod, "mins", None)

    def time_unsplit(mods: list[nn.Module]) -> float:
        x = xs[mods[0].in_features]
        return graph_time([lambda m=m: int4_linear(x, *args(m), code_bits(m)) for m in mods])

    def time_split(mods: list[nn.Module], config: Config) -> float:
        x = xs[mods[0].in_features]
        calls = [lambda m=m: int4_gemv_split(x, *args(m), config, counters, code_bits(m))
                 for m in mods]  # fmt: skip
        return graph_time_or_inf(calls)

    def configs(n: int, k: int, group: int, mins: bool, bits: int) -> list[Config]:
        return candidates(n, k, sms, bits)

    with torch.inference_mode():
        chosen = choose(shapes, configs, time_unsplit, time_split)
    for key, (config, best, base) in chosen.items():
        for mod in shapes[key]:
            mod.forward = Int4SplitGemv(mod, config, counters)
        log.info("int%d linears %dx%d, group %d (%d): split-K GEMV %s %.1f us, unsplit %.1f us",
                 key[4], key[0], key[1], key[2], len(shapes[key]), config, best * 1e6,
                 base * 1e6)  # fmt: skip
    torch.cuda.synchronize()
