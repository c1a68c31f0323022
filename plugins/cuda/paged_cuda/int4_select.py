"""Measured configs for int4 linears of few rows (decode of AWQ / GPTQ checkpoints and of a
GGUF's Q4 / Q8_0 blocks kept 4- / 8-bit on the GPU).

Those run paged's split-K int4 GEMM (paged.kernels.int4_gemm_split) on a default config picked
from the shape alone. At start-up, for each int4 weight shape among the model's linears, the
default and a few other configs are timed at one row, each in a CUDA graph over every weight of
that shape (so they come from HBM, as in a decode step); a shape whose best config beats the
default by gemv_select.MARGIN runs it for inputs of up to TUNED_MAX_ROWS rows. A shape is
(n, k, group, with mins, code bits).
"""

from __future__ import annotations

import logging

import torch
import triton
from torch import nn

from paged.kernels.int4_gemm import Int4TunedGemm, int4_linear
from paged.kernels.int4_gemm_split import Config, code_bits, default_config
from paged_cuda.gemv_select import (
    choose,
    compile_configs,
    graph_time,
    graph_time_or_inf,
    model_dtype,
)

log = logging.getLogger("paged")

Shape = tuple[int, int, int, bool, int]  # (n, k, group, with mins, code bits)


def candidates(n: int, k: int, sms: int, bits: int = 4) -> list[Config]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT, warps) to try for an int4 (`bits` 8: int8) weight of
    n outputs and k inputs on a GPU of `sms` SMs, one block of 16 rows: 64 or 128 outputs, K
    steps of 16 or 32 code words, enough programs to fill the SMs one to sixteen times over,
    each slice of K at least one step and none empty; the default config excepted."""
    out = []
    default = default_config(1, n, k, bits)
    for block_n in (64, 128):
        tiles = triton.cdiv(n, block_n)
        for block_k in (16 * 32 // bits, 32 * 32 // bits):
            for split in (1, 2, 4, 8):
                per = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
                if not sms <= tiles * split <= 16 * sms or per * (split - 1) >= k:
                    continue
                config = (16, block_n, block_k, split, 4)
                if config != default:
                    out.append(config)
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


def use_measured_int4_gemm(model: nn.Module) -> None:
    """Time and install the split int4 GEMM's best config per weight shape where it beats the
    default one."""
    shapes = int4_linears(model)
    if not shapes:
        return
    device = next(iter(shapes.values()))[0].codes.device
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    dtype = model_dtype(model)
    xs = {key[1]: torch.randn(1, key[1], device=device, dtype=dtype) for key in shapes}

    def gemm(mod: nn.Module, config: Config | None = None) -> torch.Tensor:
        """mod's int4 linear of one row under `config` (None: the default one)."""
        mins = getattr(mod, "mins", None)
        return int4_linear(xs[mod.in_features], mod.codes, mod.scales, mod.zeros, mod.group_k,
                           mod.bias, mins, code_bits(mod), config)  # fmt: skip

    def time_default(mods: list[nn.Module]) -> float:
        return graph_time([lambda m=m: gemm(m) for m in mods])

    def time_config(mods: list[nn.Module], config: Config) -> float:
        return graph_time_or_inf([lambda m=m: gemm(m, config) for m in mods])

    def configs(n: int, k: int, group: int, mins: bool, bits: int) -> list[Config]:
        return candidates(n, k, sms, bits)

    compile_configs(shapes, configs, gemm, device)
    with torch.inference_mode():
        chosen = choose(shapes, configs, time_default, time_config)
    for key, (config, best, base) in chosen.items():
        for mod in shapes[key]:
            mod.forward = Int4TunedGemm(mod, config)
        log.info("int%d linears %dx%d, group %d (%d): split-K GEMM %s %.1f us, default %.1f us",
                 key[4], key[0], key[1], key[2], len(shapes[key]), config, best * 1e6,
                 base * 1e6)  # fmt: skip
    torch.cuda.synchronize()
