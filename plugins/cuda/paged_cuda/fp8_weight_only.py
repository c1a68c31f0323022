"""Weight-only fp8 for one-row linears (`--cuda-fp8-weight-only-decode`, off by default).

With `--quantization fp8` a decode GEMV quantizes its input row to e4m3 per token, as the
prefill GEMMs do (fp8_select's kernels): every program first needs the row's absmax, and the
product runs on the tensor cores. Weight-only, the fp8 weight is converted inside paged's
split-K GEMV (paged.kernels.gemv.gemv_split_k with `scale`) and the row stays in the model's
dtype: no absmax pass, the residual add and RMSNorm or SiLU-and-mul folded in (or left to
their own kernels) as for 16-bit weights, and closer to the 16-bit model's numbers (the row is
not rounded to 3 mantissa bits). It changes results, so it is an option, not a timed choice;
start-up timing (with `cuda_tuned_gemv`) picks only the config per weight shape and whether
the op before is folded in (gemv_select.choices). Inputs of 2-4 rows keep the fp8 linear's own
arithmetic.
"""

from __future__ import annotations

import logging
import math

import torch
import triton
from torch import nn

from paged.kernels.gemv import OneRowGemv, split_k_counters
from paged_cuda.fp8_select import device_limits, fp8_linears
from paged_cuda.gemv_select import (
    Choice,
    OpInputs,
    choices,
    compile_configs,
    gemv_calls,
    graph_time_or_inf,
    model_dtype,
    op_shapes,
)

log = logging.getLogger("paged")

Config = tuple[int, int, int, int]  # (BLOCK_N, BLOCK_K, SPLIT, warps)


def default_config(n: int, k: int, sms: int) -> Config:
    """Untimed: 4 rows by up to 1024 columns a step, K split (up to 8 ways, a slice at least a
    step) only as far as it takes for two programs an SM."""
    block_k = min(1024, triton.next_power_of_2(k))
    blocks = triton.cdiv(n, 4)
    splits = [s for s in (1, 2, 4, 8) if s == 1 or k // s >= block_k]
    split = next((s for s in splits if blocks * s >= 2 * sms), splits[-1])
    return 4, block_k, split, 4


def use_weight_only_fp8_gemv(model: nn.Module, timed: bool) -> None:
    """Run every per-channel fp8 linear's one-row inputs weight-only on the split-K GEMV, each
    weight shape on its fastest config (`timed`: with the op before it folded in, or after the
    op's own kernel) or on default_config, the op folded in."""
    shapes = fp8_linears(model)
    if not shapes:
        return
    device = next(iter(shapes.values()))[0].weight.device
    sms, _ = device_limits(device)
    inputs = OpInputs(model, {k for _, k in shapes}, device, model_dtype(model))
    with_op = op_shapes(shapes, inputs)

    def tries(n: int, k: int) -> list[Choice]:
        """What is timed for weight [n, k] (nothing untimed, or where no split fills the GPU)."""
        return choices(n, k, (n, k) in with_op, itemsize=1) if timed else []

    most = max(split_k_counters(n, 1, c) for n, k in shapes
               for c in [*(c for c, _ in tries(n, k)), default_config(n, k, sms)])  # fmt: skip
    counters = torch.zeros(most, dtype=torch.int32, device=device)

    def calls(mods: list[nn.Module], choice: Choice) -> list:
        return gemv_calls(inputs, mods, choice, counters, scale=True)

    if timed:
        compile_configs(shapes, tries, lambda m, c: calls([m], c)[0](), device)
    for (n, k), mods in shapes.items():
        best, (config, fold) = math.inf, (default_config(n, k, sms), True)
        if tries(n, k):
            with torch.inference_mode():
                best, fastest = min((graph_time_or_inf(calls(mods, c)), c) for c in tries(n, k))
            if math.isfinite(best):
                config, fold = fastest
        for mod in mods:
            mod.forward = OneRowGemv(mod, config, counters, mod.weight_scale, fold)
        log.info("fp8 linears %dx%d (%d): weight-only split-K GEMV %s%s%s", n, k, len(mods),
                 config, "" if fold or (n, k) not in with_op else " after the op's kernel",
                 f", {best * 1e6:.1f} us" if math.isfinite(best) else "")  # fmt: skip
    torch.cuda.synchronize()
