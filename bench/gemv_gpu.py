"""Decode GEMVs on one GPU (batch-1 decode reads every weight once a token): paged's Triton
GEMV (paged.kernels.gemv) against cuBLAS, per Llama-3.1-8B projection, M = 1.

    python bench/gemv_gpu.py [--sweep bf16,fp8,fp8dot,fp8split,fp8wo] [--rows 1] [--pdl]
                             [--shapes o,down]

Per shape (qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down 4096x14336, head
128256x4096): bf16 F.linear (cuBLAS), fp8 torch._scaled_mm with paged's per-token quantization
kernel in front (the cuda plugin's path for many rows), paged's fp8 GEMV quantizing the
activation inside (CUDA cores, and on the tensor cores with the operands swapped), and paged's
plain bf16 GEMV. Times are medians inside a CUDA graph that cycles through enough copies of
the weight to spill L2 (every call reads HBM). `--sweep` times every config of the GEMVs
named and prints the best per shape beside the default's; `fp8split`, the tensor-core GEMV
split over K (paged.kernels.fp8_gemv), also the best of the configs that the cuda plugin's
start-up timing tries (paged_cuda.fp8_select); `fp8wo`, weight-only fp8 (the fp8 weight
converted inside the 16-bit split-K GEMV, the row not quantized: paged_cuda.fp8_weight_only),
also the best of its start-up candidates. GB/s: weight bytes over time.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "plugins" / "cuda"))

SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096),
          ("down", 4096, 14336), ("head", 128256, 4096)]  # fmt: skip
L2_SPILL = 256 << 20  # bytes of weight copies cycled per timing (H200's L2 is 50 MB)
# (BLOCK_N, BLOCK_K, warps): the accumulator at most 128 float32 registers a thread
CONFIGS = [c for c in itertools.product((4, 8, 16, 32, 64), (256, 512, 1024), (4, 8))
           if c[0] * c[1] <= 4096 * c[2]]  # fmt: skip
# the tensor-core fp8 GEMV: (BLOCK_N, BLOCK_K, warps, stages)
DOT_CONFIGS = [*itertools.product((16, 32, 64, 128), (128, 256, 512), (4, 8), (3,)),
               *itertools.product((16, 32, 64, 128), (128, 256, 512), (4,), (4,))]  # fmt: skip
# the tensor-core fp8 GEMV split over K: (BLOCK_N, BLOCK_K, SPLIT, warps, stages)
SPLIT_CONFIGS = list(itertools.product((16, 32, 64, 128), (256, 512), (1, 2, 3, 4, 6, 8), (4,),
                                       (2, 3, 4)))  # fmt: skip
# the split-K GEMV on fp8 weights: (BLOCK_N, BLOCK_K, SPLIT, warps), at most 128 sums a thread
WO_CONFIGS = [c for c in itertools.product((2, 4, 8, 16, 32), (512, 1024, 2048), (1, 2, 4, 8),
                                           (4, 8)) if c[0] * c[1] <= 4096 * c[3]]  # fmt: skip


def timed(fn, copies: int) -> float:
    """Median ms of one call (fn cycles through `copies` weights)."""
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(fn, rep=50, return_mode="median") / copies


def bench_shape(name: str, n: int, k: int, m: int, sweep: list[str], gen) -> None:
    from paged.kernels.fp8_gemm import quantize_fp8_rows
    from paged.kernels.fp8_gemv import fp8_gemv_split
    from paged.kernels.gemv import dot_config, fp8_gemv_dot, gemv, gemv_config, gemv_split_k
    from paged_cuda.fp8_select import candidates
    from paged_cuda.fp8_weight_only import default_config
    from paged_cuda.gemv_select import candidates as wo_candidates

    dev, bf16 = "cuda", torch.bfloat16
    copies = max(1, L2_SPILL // (n * k))
    w = [torch.randn(n, k, device=dev, dtype=bf16, generator=gen) * 0.02 for _ in range(copies)]
    q = [quantize_fp8_rows(t) for t in w]
    x = torch.randn(m, k, device=dev, dtype=bf16, generator=gen)

    def mm():
        for a, s in q:
            xq, xs = quantize_fp8_rows(x)
            torch._scaled_mm(xq, a.t(), scale_a=xs, scale_b=s.view(1, n), out_dtype=bf16)

    def plain(cfg=None):
        return lambda: [gemv(x, t, config=cfg) for t in w]

    def fp8(cfg=None):
        return lambda: [gemv(x, a, s, k, quantize_x=True, config=cfg) for a, s in q]

    def fp8dot(cfg=None):  # None: the kernel's own choice (gemv.dot_config)
        return lambda: [fp8_gemv_dot(x, a, s, config=cfg) for a, s in q]

    counters = torch.zeros(n * m, dtype=torch.int32, device=dev)

    def fp8split(cfg):
        return lambda: [fp8_gemv_split(x, a, s, None, cfg, counters) for a, s in q]

    def fp8wo(cfg):
        return lambda: [gemv_split_k(x, a, None, cfg, counters, None, False, s) for a, s in q]

    props = triton.runtime.driver.active.utils.get_device_properties(x.device.index or 0)
    wo_default = default_config(n, k, props["multiprocessor_count"])

    rows = {
        "bf16 cuBLAS": (2, lambda: [torch.nn.functional.linear(x, t) for t in w]),
        "bf16 paged GEMV": (2, plain()),
        "fp8 paged GEMV (quant inside)": (1, fp8()),
        "fp8 paged tensor-core GEMV": (1, fp8dot()),
        "fp8 weight-only split-K GEMV": (1, fp8wo(wo_default)),
    }
    if torch.cuda.get_device_capability() >= (8, 9):
        rows["fp8 quant + _scaled_mm"] = (1, mm)
    for label, (size, fn) in rows.items():
        ms = timed(fn, copies)
        print(f"{name:8s} {n:6d}x{k:<6d} {label:32s} {ms * 1e3:8.1f} us "
              f"{size * n * k / ms / 1e6:6.0f} GB/s", flush=True)  # fmt: skip
    tried = candidates(n, k, props["multiprocessor_count"], props["max_shared_mem"])
    split_configs = [c for c in SPLIT_CONFIGS if k // c[2] >= c[1]] + tried
    bn, bk, warps, stages = dot_config(n, k, x.device)
    kinds = {"bf16": (2, plain, CONFIGS, gemv_config(n, k, 2)),
             "fp8": (1, fp8, CONFIGS, gemv_config(n, k, 1)),
             "fp8dot": (1, fp8dot, DOT_CONFIGS, dot_config(n, k, x.device)),
             "fp8split": (1, fp8split, split_configs, (bn, bk, 1, warps, stages)),
             "fp8wo": (1, fp8wo, [c for c in WO_CONFIGS if k // c[2] >= c[1]]
                       + wo_candidates(n, k, itemsize=1), wo_default)}  # fmt: skip
    for label in sweep:
        size, make, configs, default = kinds[label]
        best = []
        for cfg in dict.fromkeys(configs):
            try:
                best.append((timed(make(cfg), copies), cfg))
            except triton.runtime.errors.OutOfResources:  # shared memory: too many stages
                pass
        best.sort()
        ms_of = {c: ms for ms, c in best}
        d_ms = ms_of.get(default, float("nan"))
        top = ", ".join(f"{c} {size * n * k / ms / 1e6:.0f}" for ms, c in best[:4])
        print(f"{name:8s} {label} sweep: best config GB/s: {top}; default {default} "
              f"{size * n * k / d_ms / 1e6:.0f} GB/s", flush=True)  # fmt: skip
        if label == "fp8split" and tried:  # what start-up timing would install
            ms, c = min((ms_of.get(c, float("inf")), c) for c in tried)
            print(f"{name:8s} fp8split start-up candidates ({len(tried)}): best {c} "
                  f"{ms * 1e3:.1f} us {n * k / ms / 1e6:.0f} GB/s", flush=True)  # fmt: skip
        if label == "fp8wo":
            wo = wo_candidates(n, k, itemsize=1)
            ms, c = min([(ms_of.get(c, float("inf")), c) for c in wo] or [(d_ms, default)])
            print(f"{name:8s} fp8wo start-up candidates ({len(wo)}): best {c} "
                  f"{ms * 1e3:.1f} us {n * k / ms / 1e6:.0f} GB/s", flush=True)  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", default="", help="comma-separated: bf16, fp8, fp8dot, fp8split, "
                    "fp8wo: time every config of those GEMVs")  # fmt: skip
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--pdl", action="store_true", help="launch paged's kernels with PDL, as the "
                    "cuda platform does on Hopper (paged.kernels.pdl)")  # fmt: skip
    ap.add_argument("--shapes", default=",".join(name for name, _, _ in SHAPES),
                    help="comma-separated: which of the shapes to time")  # fmt: skip
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/gemv_gpu.py: no CUDA device, skipping")
        return 0
    if args.pdl:
        from paged.kernels import pdl

        pdl.enable(torch.cuda.get_device_capability()[0] >= 9)
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, M = {args.rows}, medians in a CUDA graph, HBM reads")
    for name, n, k in SHAPES:
        if name not in args.shapes.split(","):
            continue
        bench_shape(name, n, k, args.rows, [s for s in args.sweep.split(",") if s], gen)
    return 0


if __name__ == "__main__":
    sys.exit(main())
