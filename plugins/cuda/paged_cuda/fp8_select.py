"""Measured config for fp8 linears at one to four rows (decode with `--quantization fp8`).

Those run paged's tensor-core fp8 GEMV (paged.kernels.gemv.fp8_gemv_dot): one program per 64
output rows over the whole K, so a projection with few output rows leaves SMs idle
(Llama-3.1-8B's o_proj and down: 64 programs on an H200's 132 SMs). At start-up, for each
per-channel fp8 weight shape among the model's linears, the unsplit kernel (its own config) and
the split-K kernel (paged.kernels.fp8_gemv: the unsplit kernel's tile and a few others unsplit,
and K split under a few configurations) are timed at one row, each in a CUDA graph over every
weight of that shape (so they come from HBM, as in a decode step). A shape whose linears follow
a residual add and RMSNorm (QKV, gate/up) or SiLU-and-mul (down) is timed with that op: its own
kernel before the unsplit GEMV, against the split kernel with the op folded in (every program
computes it and the token's scale over the whole row), and against the op's own kernel writing
the rows' absmax for the split kernel (paged.kernels.fused), as gemv_select times 16-bit
linears. A shape whose best split-kernel config beats the unsplit kernel by gemv_select.MARGIN
runs it for inputs of up to four rows. More rows keep the platform's fp8 linear.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch
import triton
from torch import nn

from paged.kernels.fp8_gemv import Config, Fp8SplitGemv, fp8_gemv_split, split_counters
from paged.kernels.fused import fused_add_rms_norm, silu_and_mul_absmax
from paged.kernels.gemv import DOT_MAX_ROWS, DOT_WIDTH, dot_config, fp8_gemv_dot
from paged_cuda.gemv_select import (
    OpInputs,
    choose,
    compile_configs,
    graph_time,
    graph_time_or_inf,
    model_dtype,
    op_shapes,
)

log = logging.getLogger("paged")

SMEM_SLACK = 8192  # shared memory kept back from the pipeline's stages (the reduction's)


def stages_for(block_n: int, block_k: int, steps: int, smem: int) -> int:
    """Pipeline stages for `steps` BLOCK_K steps a program: up to 4, no more than the steps,
    as many as the device's shared memory holds (the weight tile and 16 activation columns)."""
    stages = max(1, min(4, steps))
    while stages > 1 and stages * (block_n + DOT_WIDTH) * block_k > smem - SMEM_SLACK:
        stages -= 1
    return stages


def candidates(n: int, k: int, sms: int, smem: int) -> list[Config]:
    """(BLOCK_N, BLOCK_K, SPLIT, warps, stages) to try for weight [n, k] on a GPU of `sms`
    SMs with `smem` bytes of shared memory a block: K split so that the programs fill the
    SMs about one to four times over, no slice empty. A slice of one BLOCK_K step is a
    program whose every weight load is issued before it waits for its input (PDL) and reads
    the rows' absmax: nothing of the weight waits behind that prologue."""
    out = []
    for block_n in (32, 64, 128):
        blocks = triton.cdiv(n, block_n)
        for split in (2, 3, 4, 6, 8):
            if not sms <= blocks * split <= 4 * sms:
                continue
            for block_k in (256, 512):
                per = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
                if per < block_k or per * (split - 1) >= k:
                    continue
                stages = stages_for(block_n, block_k, per // block_k, smem)
                out.append((block_n, block_k, split, 4, stages))
    return out


def one_slice(n: int, k: int, sms: int, smem: int) -> list[Config]:
    """Unsplit tiles on the split kernel (SPLIT 1) for weights with enough output blocks to
    fill the SMs: its first weight tiles load before the PDL wait, which the unsplit
    kernel's do not (gate/up on an H100: 2,743 GB/s against 2,602 on the same tile)."""
    out = []
    for block_n, block_k in ((64, 512), (128, 256), (64, 256)):
        if triton.cdiv(n, block_n) < sms or block_k > k:
            continue
        most = stages_for(block_n, block_k, triton.cdiv(k, block_k), smem)
        out += [(block_n, block_k, 1, 4, s) for s in sorted({min(3, most), most})]
    return out


def tried(n: int, k: int, sms: int, smem: int, device: torch.device,
          op_before: bool) -> list[tuple[Config, str]]:  # fmt: skip
    """(config, rows) that start-up timing tries for weight [n, k]: the unsplit kernel's tile
    on the split kernel (what folds the op in), then splits; after a norm or SiLU-and-mul
    (`op_before`) each also with the op's kernel writing the rows' absmax (Fp8SplitGemv's rows
    "amax")."""
    block_n, block_k, warps, stages = dot_config(n, k, device)
    unsplit = (block_n, block_k, 1, warps, stages)
    tiles = [unsplit, *(c for c in one_slice(n, k, sms, smem) if c != unsplit),
             *candidates(n, k, sms, smem)]  # fmt: skip
    rows = ["fold", "amax"] if op_before else ["fold"]
    return [(c, r) for r in rows for c in tiles]


def fp8_linears(model: nn.Module) -> dict[tuple[int, int], list[nn.Module]]:
    """The model's fp8 linears with per-channel scales on the GPU, by weight shape (n, k)."""
    from paged.quantization.base import QuantLinear

    shapes: dict[tuple[int, int], list[nn.Module]] = {}
    for mod in model.modules():
        if not isinstance(mod, QuantLinear) or "forward" in vars(mod):
            continue
        w, s = getattr(mod, "weight", None), getattr(mod, "weight_scale", None)
        if w is None or s is None or not w.is_cuda or w.dtype != torch.float8_e4m3fn:
            continue
        if w.dim() == 2 and s.shape == (w.shape[0], 1) and w.stride(1) == 1:
            shapes.setdefault(tuple(w.shape), []).append(mod)
    return shapes


def device_limits(device: torch.device) -> tuple[int, int]:
    """(SMs, shared memory a block in bytes) of the GPU."""
    props = triton.runtime.driver.active.utils.get_device_properties(device.index or 0)
    return props["multiprocessor_count"], props["max_shared_mem"]


def use_measured_fp8_gemv(model: nn.Module) -> None:
    """Time and install the split fp8 GEMV per weight shape where it beats the unsplit one
    (each timed with the norm or activation before it: its own kernel, or folded in)."""
    shapes = fp8_linears(model)
    if not shapes:
        return
    device = next(iter(shapes.values()))[0].weight.device
    sms, smem = device_limits(device)

    inputs = OpInputs(model, {k for _, k in shapes}, device, model_dtype(model))
    amax_shapes = op_shapes(shapes, inputs)

    def configs(n: int, k: int) -> list[tuple[Config, str]]:
        return tried(n, k, sms, smem, device, (n, k) in amax_shapes)

    most = max(split_counters(n, c) for n, k in shapes for c, _ in configs(n, k))
    counters = torch.zeros(most, dtype=torch.int32, device=device)

    fastest: dict[tuple, float] = {}  # (shape, rows or "unsplit"): the best time, for the log

    def unsplit_calls(mods: list[nn.Module]) -> list[Callable[[], object]]:
        """The unsplit GEMV over mods, each after the op's own kernel."""
        before = inputs.unfused(mods[0])
        return [lambda m=m: fp8_gemv_dot(before(), m.weight, m.weight_scale, m.bias)
                for m in mods]  # fmt: skip

    def time_unsplit(mods: list[nn.Module]) -> float:
        t = graph_time(unsplit_calls(mods))
        fastest[(tuple(mods[0].weight.shape), "unsplit")] = t
        return t

    def split_call(mod: nn.Module, choice: tuple[Config, str]) -> Callable[[nn.Module], object]:
        """The split GEMV under `choice` as a function of a module of mod's shape (and under
        rows "amax", the op's kernel before it), on inputs shared by that shape's modules."""
        config, rows = choice
        x, folded, silu = inputs.folded(mod)
        if rows == "amax":  # the op's kernel writes the absmax (the norm's in place: copies)
            amax = torch.empty(1, 1, dtype=torch.float32, device=device)
            x, res = x.clone(), folded[0].clone() if folded else None

        def call(m: nn.Module) -> torch.Tensor:
            if rows == "amax" and silu:
                act, parts = silu_and_mul_absmax(x)
                return fp8_gemv_split(act, m.weight, m.weight_scale, m.bias, config, counters,
                                      x_amax=parts)  # fmt: skip
            if rows == "amax":
                normed, _ = fused_add_rms_norm(x, res, folded[1], folded[2], amax)
                return fp8_gemv_split(normed, m.weight, m.weight_scale, m.bias, config,
                                      counters, x_amax=amax)  # fmt: skip
            return fp8_gemv_split(x, m.weight, m.weight_scale, m.bias, config, counters,
                                  folded, silu)  # fmt: skip

        return call

    def time_split(mods: list[nn.Module], choice: tuple[Config, str]) -> float:
        call = split_call(mods[0], choice)
        t = graph_time_or_inf([lambda m=m: call(m) for m in mods])
        key = (tuple(mods[0].weight.shape), choice[1])
        fastest[key] = min(fastest.get(key, math.inf), t)
        return t

    compile_configs(shapes, configs, lambda m, choice: split_call(m, choice)(m), device,
                    [unsplit_calls(mods[:1])[0] for mods in shapes.values()])  # fmt: skip
    with torch.inference_mode():
        chosen = choose(shapes, configs, time_unsplit, time_split)
    for (n, k), ((config, rows), best, base) in chosen.items():
        for mod in shapes[(n, k)]:
            mod.forward = Fp8SplitGemv(mod, config, counters, DOT_MAX_ROWS, rows)
        log.info("fp8 linears %dx%d (%d): split-K GEMV %s, rows %s, %.1f us; unsplit %.1f us",
                 n, k, len(shapes[(n, k)]), config, rows, best * 1e6, base * 1e6)  # fmt: skip
    for (shape, rows), t in sorted(fastest.items()):
        log.debug("fp8 linears %dx%d: %s %.1f us", *shape, rows if rows == "unsplit" else
                  f"best split-K GEMV with rows {rows}", t * 1e6)  # fmt: skip
    torch.cuda.synchronize()
