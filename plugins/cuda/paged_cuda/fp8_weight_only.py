"""Weight-only fp8 for one-row linears (`--cuda-fp8-weight-only-decode`, off by default).

With `--quantization fp8` a decode GEMV quantizes its input row to e4m3 per token, as the
prefill GEMMs do (fp8_select's kernels): every program first needs the row's absmax, and the
product runs on the tensor cores. Weight-only, the fp8 weight is converted inside paged's
split-K GEMV (paged.kernels.gemv.gemv_split_k with `scale`) and the row stays in the model's
dtype: no absmax pass, the residual add and RMSNorm or SiLU-and-mul folded in as for 16-bit
weights, and closer to the 16-bit model's numbers (the row is not rounded to 3 mantissa
bits). It changes results, so it is an option, not a timed choice; start-up timing (with
`cuda_tuned_gemv`) picks only its config per weight shape. Inputs of 2-4 rows keep the fp8
linear's own arithmetic.
"""

from __future__ import annotations

import logging
import math

import torch
import triton
from torch import nn

from paged.kernels.gemv import OneRowGemv, gemv_split_k, split_k_counters
from paged_cuda.fp8_select import device_limits, fp8_linears
from paged_cuda.gemv_select import (
    OpInputs,
    candidates,
    compile_configs,
    graph_time_or_inf,
    model_dtype,
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
    weight shape on its fastest config (`timed`, with the op before it folded in) or on
    default_config."""
    shapes = fp8_linears(model)
    if not shapes:
        return
    device = next(iter(shapes.values()))[0].weight.device
    sms, _ = device_limits(device)

    def configs(n: int, k: int) -> list[Config]:
        """The configs timed for weight [n, k] (none untimed, or where no split fills the GPU)."""
        return candidates(n, k, itemsize=1) if timed else []

    most = max(split_k_counters(n, 1, c) for n, k in shapes
               for c in [*configs(n, k), default_config(n, k, sms)])  # fmt: skip
    counters = torch.zeros(most, dtype=torch.int32, device=device)
    inputs = OpInputs(model, {k for _, k in shapes}, device, model_dtype(model))

    def gemv(mod: nn.Module, config: Config) -> torch.Tensor:
        x, folded, silu = inputs.folded(mod)
        return gemv_split_k(x, mod.weight, mod.bias, config, counters, folded, silu,
                            mod.weight_scale)  # fmt: skip

    if timed:
        compile_configs(shapes, configs, gemv, device)
    for (n, k), mods in shapes.items():
        best, config = math.inf, default_config(n, k, sms)
        if configs(n, k):
            with torch.inference_mode():
                best, fastest = min((graph_time_or_inf([lambda m=m, c=c: gemv(m, c)
                                                        for m in mods]), c)
                                    for c in configs(n, k))  # fmt: skip
            if math.isfinite(best):
                config = fastest
        for mod in mods:
            mod.forward = OneRowGemv(mod, config, counters, mod.weight_scale)
        log.info("fp8 linears %dx%d (%d): weight-only split-K GEMV %s%s", n, k, len(mods),
                 config, f", {best * 1e6:.1f} us" if math.isfinite(best) else "")  # fmt: skip
    torch.cuda.synchronize()
