"""What compiling start-up timing's kernel variants ahead on threads saves, measured without a
GPU: Triton compiles for sm_90 (an H100 / H200) from the CPU alone.

`--quantization fp8` start-up timing (paged_cuda.fp8_select) tries, for each of
Llama-3.1-8B's four fp8 weight shapes on an H200 (132 SMs, 227 KB of shared memory a block),
the split fp8 GEMV under every candidate config, with the op before it folded in and, after a
norm or SiLU-and-mul, with that op's kernel writing the rows' absmax. On an empty Triton
cache each is a compile. This compiles exactly those variants of
`paged.kernels.fp8_gemv._fp8_gemv_split_kernel` (as the engine launches them at one row, PDL
on) one after another, then again (a fresh cache) on `--threads` threads, as
`paged.kernels.compile_ahead` does at start-up, and reports both.

    python bench/compile_ahead_cpu.py [--threads N] [--limit 24]

Results: bench/results/compile-ahead.md (and compile-ahead-latest.json).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "plugins" / "cuda"))

SMS, SMEM = 132, 232448  # an H200 (and an H100 SXM): SMs, shared memory a block
# Llama-3.1-8B's fp8 linears: (n, k, the op before them)
SHAPES = {"qkv": (6144, 4096, "norm"), "o": (4096, 4096, None),
          "gate_up": (28672, 4096, "norm"), "down": (4096, 14336, "silu")}  # fmt: skip
POINTERS = {"x_ptr": "*bf16", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32",
            "bias_ptr": "*bf16", "out_ptr": "*bf16", "part_ptr": "*fp32", "count_ptr": "*i32",
            "res_ptr": "*bf16", "g_ptr": "*bf16", "res_out_ptr": "*bf16"}  # fmt: skip
INTS = ("M", "N", "K", "k_per_split", "stride_xm", "stride_wn", "stride_om", "xs_cols")


def variants() -> list[tuple[str, tuple, str]]:
    """(shape, config, rows) for every split-GEMV variant fp8_select times on an H200."""
    import torch

    from paged_cuda.fp8_select import tried

    meta = torch.device("meta")  # dot_config's tile as is: it fits an H200's shared memory
    return [(name, config, rows) for name, (n, k, op) in SHAPES.items()
            for config, rows in tried(n, k, SMS, SMEM, meta, op is not None)]  # fmt: skip


def compile_one(variant: tuple[str, tuple, str]) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from paged.kernels.fp8_gemv import AMAX_ELEMENTS, _fp8_gemv_split_kernel

    name, (block_n, block_k, split, warps, stages), rows = variant
    n, k, op = SHAPES[name]
    silu_parts = triton.cdiv(k, 1024)  # fused._silu_block: the blocks of 1024 a row
    constexprs = dict(
        HAS_BIAS=False, NORM=op == "norm" and rows == "fold",
        SILU_MUL=op == "silu" and rows == "fold", X_AMAX=rows == "amax",
        XS_PAD=triton.next_power_of_2(silu_parts) if rows == "amax" and op == "silu" else 1,
        ROWS=1, SPLIT=split, BLOCK_N=block_n, BLOCK_K=block_k,
        AMAX_K=min(AMAX_ELEMENTS, max(16, triton.next_power_of_2(k))), PDL=True,
    )  # fmt: skip
    signature = {**POINTERS, **dict.fromkeys(INTS, "i32"), "eps": "fp32",
                 **dict.fromkeys(constexprs, "constexpr")}  # fmt: skip
    src = ASTSource(_fp8_gemv_split_kernel, signature, constexprs)
    triton.compile(src, target=GPUTarget("cuda", 90, 32),
                   options=dict(num_warps=warps, num_stages=stages, launch_pdl=True))  # fmt: skip


def timed(todo: list, threads: int) -> float:
    """Seconds to compile `todo` on `threads` threads, on an empty Triton cache."""
    from triton import knobs

    with tempfile.TemporaryDirectory() as cache:
        knobs.cache.dir = cache
        t0 = time.perf_counter()
        if threads == 1:
            for v in todo:
                compile_one(v)
        else:
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(compile_one, todo))
        return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--limit", type=int, default=0, help="compile only the first N variants")
    args = ap.parse_args()
    from common import write_results

    todo = variants()
    total = len(todo)
    if args.limit:
        todo = todo[: args.limit]
    compile_one(todo[0])  # imports and first-use set-up, outside the timings
    serial = timed(todo, 1)
    print(f"{len(todo)} of {total} variants, one after another: {serial:.1f} s", flush=True)
    parallel = timed(todo, args.threads)
    print(f"on {args.threads} threads: {parallel:.1f} s ({serial / parallel:.2f}x)", flush=True)
    rows = [("one after another", f"{serial:.1f} s"),
            (f"on {args.threads} threads (paged.kernels.compile_ahead)", f"{parallel:.1f} s"),
            ("speed-up", f"{serial / parallel:.2f}x")]  # fmt: skip
    write_results("compile-ahead.md",
                  f"fp8 start-up variants compiled for sm_90: {len(todo)} of {total}",
                  rows, {"variants": len(todo), "of": total, "threads": args.threads,
                         "serial_s": serial, "threads_s": parallel})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
