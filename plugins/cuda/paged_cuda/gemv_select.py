"""Measured kernel choice for one-row dense linears (batch-1 decode).

cuBLAS reads a small projection (Qwen3-30B-A3B's o_proj: 2048 x 4096, its router: 128 x 2048)
at well under the HBM bandwidth: too few output blocks to fill the GPU, or a split-K with a
separate reduction kernel. At start-up, for each weight shape among the model's dense linears,
cuBLAS and paged's split-K GEMV (paged.kernels.gemv.gemv_split_k) under a few configurations
are timed at one row, each in a CUDA graph over every weight of that shape (so they come from
HBM, as in a decode step); a shape whose best GEMV beats cuBLAS by MARGIN runs it for one-row
inputs. Other row counts stay on cuBLAS.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
import triton
from torch import nn

from paged.kernels.compile_ahead import compile_ahead, default_workers
from paged.kernels.gemv import OneRowGemv, gemv_split_k, split_k_counters

log = logging.getLogger("paged")

MARGIN = 0.97  # a GEMV is taken only when it takes at most this fraction of cuBLAS's time
REPLAYS = 5


def candidates(n: int, k: int, itemsize: int = 2) -> list[tuple[int, int, int, int]]:
    """(BLOCK_N, BLOCK_K, SPLIT, warps) to try for weight [n, k]: enough programs to fill the
    GPU's SMs about one to thirty times, each slice of K at least one BLOCK_K step, each
    program's tile at most 8192 float32 sums (64 registers a lane at 4 warps). 1-byte (fp8)
    weights take twice the BLOCK_K where that fits: a step's load as many bytes as 16-bit's."""
    out = []
    for block_n in (4, 8, 16, 32):
        blocks = triton.cdiv(n, block_n)
        for split in (1, 2, 4, 8):
            if not 128 <= blocks * split <= 4096 or k // split < 256:
                continue
            block_k = 512 if k // split >= 512 and block_n <= 16 else 256
            if itemsize == 1 and k // split >= 2 * block_k and block_n * block_k <= 4096:
                block_k *= 2
            out.append((block_n, block_k, split, 4))
    return out


def graph_time(calls: list[Callable[[], object]]) -> float:
    """Seconds per call: the calls captured once in a CUDA graph, replayed REPLAYS times."""
    for call in calls:  # compile, allocate
        call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / (REPLAYS * len(calls))


def graph_time_or_inf(calls: list[Callable[[], object]]) -> float:
    """graph_time, or infinity for a config whose kernel does not fit the GPU (Triton's
    OutOfResources, raised at the first, uncaptured, call)."""
    try:
        return graph_time(calls)
    except triton.runtime.errors.OutOfResources:
        return math.inf


def model_dtype(model: nn.Module) -> torch.dtype:
    """The model's 16-bit dtype (quantized layers hold float32 scales beside it), else float32."""
    half = (torch.bfloat16, torch.float16)
    return next((p.dtype for p in model.parameters() if p.dtype in half), torch.float32)


def choose(
    shapes: dict[tuple, list],
    configs: Callable[..., list],
    time_base: Callable[[list], float],
    time_config: Callable[[list, tuple], float],
) -> dict[tuple, tuple[tuple, float, float]]:
    """{shape: (config, its seconds, the baseline's seconds)} for the shapes (tuples starting
    with the weight's (n, k)) where one of `configs(*shape)` takes at most MARGIN of the
    baseline kernel's time. Timers are injected (tests run without a GPU); a config that does not
    compile or run times as infinite. Shapes with no candidate config (e.g. an LM head: enough
    output blocks already) are not timed."""
    chosen = {}
    for shape, mods in shapes.items():
        tries = configs(*shape)
        if not tries:
            continue
        base = time_base(mods)
        best, config = min((time_config(mods, c), c) for c in tries)
        if best <= MARGIN * base and math.isfinite(best):
            chosen[shape] = (config, best, base)
    return chosen


def compile_configs(
    shapes: dict[tuple, list],
    configs: Callable[..., list],
    run: Callable[[nn.Module, tuple], object],
    device: torch.device,
    also: Sequence[Callable[[], object]] = (),
) -> None:
    """Compile every shape's configs ahead, side by side on threads (`compile_ahead`): `run`
    (a shape's first module, a config) is what the timing will launch, and Triton compiles
    the kernels it launches without running them; `also`, other calls the timing makes."""

    @contextlib.contextmanager
    def within():
        with torch.cuda.device(device), torch.inference_mode():
            yield

    calls = [lambda m=mods[0], c=c: run(m, c) for shape, mods in shapes.items()
             for c in configs(*shape)]  # fmt: skip
    calls += also
    if not calls:
        return
    workers = min(len(calls), default_workers())
    failed, seconds = compile_ahead(calls, within, workers)
    log.info("compiled %d kernel variants for start-up timing in %.1f s on %d threads%s",
             len(calls), seconds, workers,
             f" ({failed} failed)" if failed else "")  # fmt: skip


def dense_linears(model: nn.Module) -> dict[tuple[int, int], list[nn.Linear]]:
    """The model's 16-bit nn.Linear layers on the GPU, by weight shape (n, k)."""
    shapes: dict[tuple[int, int], list[nn.Linear]] = {}
    for mod in model.modules():
        w = getattr(mod, "weight", None)
        if type(mod) is not nn.Linear or w is None or not w.is_cuda or w.dim() != 2:
            continue
        if w.dtype in (torch.bfloat16, torch.float16) and w.stride(1) == 1:
            shapes.setdefault(tuple(w.shape), []).append(mod)
    return shapes


def _layer_linears(model: nn.Module, which: str) -> set[int]:
    """ids of the linears every decoder layer lists by its method `which`."""
    from paged.model.llama import DecoderLayer

    return {id(lin) for layer in model.modules() if isinstance(layer, DecoderLayer)
            for lin in getattr(layer, which)()}  # fmt: skip


def normed_linears(model: nn.Module) -> set[int]:
    """ids of the linears whose input is a residual add and RMSNorm that the GEMV takes in
    (add_rms_norm_linear: a decoder layer's QKV and its dense gate/up projection)."""
    return _layer_linears(model, "normed_linears")


def gated_linears(model: nn.Module) -> set[int]:
    """ids of the linears whose input is SiLU-and-mul of a gate/up output, which the GEMV
    takes in (silu_and_mul_linear: a dense MLP's down projection)."""
    return _layer_linears(model, "gated_linears")


class OpInputs:
    """One-row inputs for timing a model's decode linears with the op before each (a residual
    add and RMSNorm before normed_linears, SiLU-and-mul before gated_linears): random rows per
    input width K, and how each linear's input comes about unfused and folded."""

    def __init__(self, model: nn.Module, ks: set[int], device: torch.device,
                 dtype: torch.dtype) -> None:  # fmt: skip
        from paged.model import ops

        self.x = {k: torch.randn(1, k, device=device, dtype=dtype) for k in ks}
        self.res = {k: torch.randn(1, k, device=device, dtype=dtype) for k in ks}
        self.gain = {k: torch.rand(k, device=device, dtype=dtype) + 0.5 for k in ks}
        self.gate_up = {k: torch.randn(1, 2 * k, device=device, dtype=dtype) for k in ks}
        self.normed, self.gated = normed_linears(model), gated_linears(model)
        self.norm, self.act = ops.get("fused_add_rms_norm"), ops.get("silu_and_mul")

    def unfused(self, mod: nn.Module) -> Callable[[], torch.Tensor]:
        """mod's input by the op's own kernel (a call to capture before the linear's)."""
        k = mod.weight.shape[1]
        x, r, g = self.x[k].clone(), self.res[k].clone(), self.gain[k]
        if id(mod) in self.normed:  # (the norm updates x and r in place: no matter here)
            return lambda: self.norm(x, r, g, 1e-6)[0]
        if id(mod) in self.gated:
            return lambda: self.act(self.gate_up[k])
        return lambda: x

    def folded(self, mod: nn.Module) -> tuple[torch.Tensor, tuple | None, bool]:
        """(x, norm, silu_mul): the arguments of a GEMV that folds mod's op in."""
        k = mod.weight.shape[1]
        norm = (self.res[k], self.gain[k], 1e-6) if id(mod) in self.normed else None
        silu = id(mod) in self.gated
        return (self.gate_up[k] if silu else self.x[k]), norm, silu


Choice = tuple[tuple[int, int, int, int], bool]  # (config, whether the op before is folded in)


def choices(n: int, k: int, op_before: bool, itemsize: int = 2) -> list[Choice]:
    """What start-up times for weight [n, k]: each candidate config with the op before the
    linear (if any) folded in, and after a norm or SiLU-and-mul (`op_before`) also after the
    op's own kernel (folded, every program computes the op for its columns, once per row it
    covers: more arithmetic, one launch less)."""
    configs = candidates(n, k, itemsize)
    return [(c, True) for c in configs] + ([(c, False) for c in configs] if op_before else [])


def gemv_calls(inputs: OpInputs, mods: list[nn.Module], choice: Choice, counters: torch.Tensor,
               scale: bool = False) -> list[Callable[[], object]]:  # fmt: skip
    """The split-K GEMV over mods under `choice`, on inputs shared by the shape's modules;
    unfolded, each call after the op's own kernel. `scale`: the modules' weights are fp8 with
    per-row `weight_scale` (weight-only)."""
    config, fold = choice
    x, folded, silu = inputs.folded(mods[0])
    before = None if fold else inputs.unfused(mods[0])

    def call(m: nn.Module) -> object:
        s = m.weight_scale if scale else None
        if fold:
            return gemv_split_k(x, m.weight, m.bias, config, counters, folded, silu, s)
        return gemv_split_k(before(), m.weight, m.bias, config, counters, None, False, s)

    return [lambda m=m: call(m) for m in mods]


def op_shapes(shapes: dict[tuple[int, int], list[nn.Module]], inputs: OpInputs) -> set:
    """The weight shapes whose (first) linear follows a norm or SiLU-and-mul it can fold in."""
    ops = inputs.normed | inputs.gated
    return {shape for shape, mods in shapes.items() if id(mods[0]) in ops}


def use_measured_gemv(model: nn.Module) -> None:
    """Time and install the GEMV per weight shape where it beats cuBLAS at one row. A shape
    whose linears follow a norm (or SiLU-and-mul) is timed with it: cuBLAS after the op's own
    kernel against the GEMV with the op folded in and after the op's kernel."""
    shapes = dense_linears(model)
    if not shapes:
        return
    first = next(iter(shapes.values()))[0].weight
    inputs = OpInputs(model, {k for _, k in shapes}, first.device, first.dtype)
    most = max((split_k_counters(n, 1, c) for n, k in shapes for c in candidates(n, k)),
               default=1)  # fmt: skip
    counters = torch.zeros(most, dtype=torch.int32, device=first.device)
    with_op = op_shapes(shapes, inputs)

    def tries(n: int, k: int) -> list[Choice]:
        return choices(n, k, (n, k) in with_op)

    def time_cublas(mods: list[nn.Linear]) -> float:
        before = inputs.unfused(mods[0])
        return graph_time([lambda m=m: F.linear(before(), m.weight, m.bias) for m in mods])

    def time_gemv(mods: list[nn.Linear], choice: Choice) -> float:
        return graph_time(gemv_calls(inputs, mods, choice, counters))

    compile_configs(shapes, tries, lambda m, c: gemv_calls(inputs, [m], c, counters)[0](),
                    first.device)  # fmt: skip
    with torch.inference_mode():
        chosen = choose(shapes, tries, time_cublas, time_gemv)
    for (n, k), ((config, fold), best, base) in chosen.items():
        for mod in shapes[(n, k)]:
            mod.forward = OneRowGemv(mod, config, counters, fold=fold)
        log.info("one-row linears %dx%d (%d): split-K GEMV %s%s %.1f us, cuBLAS %.1f us", n, k,
                 len(shapes[(n, k)]), config, "" if fold or (n, k) not in with_op else
                 " after the op's kernel", best * 1e6, base * 1e6)  # fmt: skip
    torch.cuda.synchronize()
