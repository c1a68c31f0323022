"""The one-row decode GEMVs' instruction mix on an H100 / H200 (sm_90), read without a GPU:
each variant of `paged.kernels.gemv._gemv_split_k_kernel` (16-bit weights, and fp8 weights
converted inside: `--cuda-fp8-weight-only-decode`) and of the fp8 tensor-core GEMV
(`paged.kernels.fp8_gemv._fp8_gemv_split_kernel`, the row quantized to e4m3) is compiled for
sm_90 with the launch's specialization (16-byte aligned pointers and strides, as the engine's
tensors are), and its SASS (Triton's bundled cuobjdump) is counted: instructions per weight
element, and the few that say where the time goes (FFMA: the products; F2FP / HADD2.F32: fp8
to float; MUFU: SiLU's exponentials; STS.U8: activation bytes stored for the tensor cores).

Counted: the K loop's body (one weight tile a trip) over the weights a thread reads in a
trip. At 4.2 TB/s an H200 streams 4.2 fp8 weights a nanosecond while its 132 SMs issue about
33,000 lane-instructions (132 x 4 schedulers x 32 lanes x 1.98 GHz), so a loop of more than
about 8 instructions a weight cannot read fp8 weights at the copy rate (16-bit weights: 16),
and well below that it still competes with the loads for issue slots. Not counted: what runs
once a program, such as the tensor-core kernel's pass over the whole row for its absmax.

    python bench/gemv_sass_cpu.py [--out bench/results/gemv-sass.md]

A model of the instruction count, not a measurement: the kernels' speed on a GPU is what
bench/gemv_gpu.py times.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "core"))

TARGET = ("cuda", 90, 32)
WATCH = ("FFMA", "F2FP", "HADD2.F32", "MUFU", "STS.U8", "QGMMA", "LDG")
ALIGNED = ("N", "K", "k_per_split", "stride_xm", "stride_wn", "stride_om")


def compile_sass(kernel, types: dict[str, str], consts: dict, warps: int, stages: int) -> str:
    """The SASS of `kernel` for sm_90 with these argument types and constants."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {a: types.get(a, "i32") for a in kernel.arg_names if a not in consts}
    sig.update(dict.fromkeys(consts, "constexpr"))
    aligned = [a for a in sig if sig[a].startswith("*") or a in ALIGNED]
    attrs = {(kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    compiled = triton.compile(ASTSource(kernel, sig, consts, attrs), target=GPUTarget(*TARGET),
                              options={"num_warps": warps, "num_stages": stages,
                                       "launch_pdl": True})  # fmt: skip
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip


def main_loop(sass: str) -> Counter:
    """The opcodes of the kernel's K loop (the backward branch's span with the most products:
    FFMA, or fp8 wgmma), one weight tile a trip."""
    lines = re.findall(r"^\s*/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)([^;]*);",
                       sass, re.MULTILINE)  # fmt: skip
    code = [(int(addr, 16), op, rest) for addr, op, rest in lines]
    loops = [(target, addr) for addr, op, rest in code if op == "BRA"
             for target in [int(re.findall(r"0x[0-9a-f]+", rest)[-1], 16)]
             if target < addr]  # fmt: skip

    def body(span: tuple[int, int]) -> Counter:
        return Counter(op for addr, op, _ in code if span[0] <= addr <= span[1])

    # the loop with the products in it (not a prepass over the row, e.g. for its absmax)
    return max((body(span) for span in loops),
               key=lambda ops: (ops["FFMA"] + ops["QGMMA.64"] * 64, sum(ops.values())))


def split_k(weight: str, block_n: int, block_k: int, op: str) -> tuple:
    from paged.kernels.gemv import _gemv_split_k_kernel

    types = {a: "*bf16" for a in _gemv_split_k_kernel.arg_names if a.endswith("_ptr")}
    types.update(w_ptr=f"*{weight}", ws_ptr="*fp32", count_ptr="*i32", ss_ptr="*fp32",
                 scale_ptr="*fp32", eps="fp32")  # fmt: skip
    consts = dict(HAS_BIAS=False, NORM=op == "norm", SILU_MUL=op == "silu",
                  W_SCALED=weight == "fp8e4nv", SPLIT=1, SPLIT_PAD=1, BLOCK_N=block_n,
                  BLOCK_K=block_k, PDL=True)  # fmt: skip
    return _gemv_split_k_kernel, types, consts, 4, 1


def fp8_dot(block_n: int, block_k: int, op: str) -> tuple:
    from paged.kernels.fp8_gemv import _fp8_gemv_split_kernel

    types = {a: "*bf16" for a in _fp8_gemv_split_kernel.arg_names if a.endswith("_ptr")}
    types.update(w_ptr="*fp8e4nv", xs_ptr="*fp32", ws_ptr="*fp32", part_ptr="*fp32",
                 count_ptr="*i32", eps="fp32")  # fmt: skip
    consts = dict(HAS_BIAS=False, NORM=op == "norm", SILU_MUL=op == "silu", X_AMAX=False,
                  XS_PAD=1, ROWS=1, SPLIT=1, BLOCK_N=block_n, BLOCK_K=block_k, AMAX_K=4096,
                  PDL=True)  # fmt: skip
    return _fp8_gemv_split_kernel, types, consts, 4, 3


VARIANTS = [  # (label, builder, its arguments): tiles of the start-up candidates' sizes
    *[(f"bf16 split-K {bn}x{bk}, {op}", split_k, ("bf16", bn, bk, op))
      for bn, bk in ((4, 512), (16, 512)) for op in ("plain", "norm", "silu")],
    *[(f"fp8 weight-only {bn}x{bk}, {op}", split_k, ("fp8e4nv", bn, bk, op))
      for bn, bk in ((4, 1024), (16, 512)) for op in ("plain", "norm", "silu")],
    *[(f"fp8 tensor-core (row quantized) {bn}x{bk}, {op}", fp8_dot, (bn, bk, op))
      for bn, bk in ((64, 256), (128, 256)) for op in ("plain", "silu")],
]  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "gemv-sass.md"))
    args = ap.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)  # compiled for the GPU, not interpreted
    os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="triton-sass-"))
    rows = []
    for label, build, build_args in VARIANTS:
        kernel, types, consts, warps, stages = build(*build_args)
        ops = main_loop(compile_sass(kernel, types, consts, warps, stages))
        per_thread = consts["BLOCK_N"] * consts["BLOCK_K"] // (32 * warps)  # weights a trip
        total = sum(ops.values())
        watch = ", ".join(f"{w} {sum(n for o, n in ops.items() if o.startswith(w))}"
                          for w in WATCH)  # fmt: skip
        rows.append((label, total, total / per_thread, watch))
        print(f"{label:45s} {total:5d} instructions a trip, {total / per_thread:5.2f} a weight; "
              f"{watch}", flush=True)  # fmt: skip
    import triton

    rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True).stdout.strip() or "unknown"
    lines = [f"\n## sm_90 SASS of the one-row GEMVs ({dt.date.today()}, commit {rev}, triton "
             f"{triton.__version__}, compiled on this CPU; `python bench/gemv_sass_cpu.py`)\n",
             "The K loop's body (one weight tile a trip) over the weight elements a thread "
             "reads in a trip; of which, per trip:\n",
             "| variant | SASS instructions a trip | a weight element | of which |",
             "|---|---|---|---|"]
    lines += [f"| {label} | {total} | {per:.2f} | {watch} |" for label, total, per, watch in rows]
    with open(args.out, "a") as f:
        f.write("\n".join(lines) + "\n")
    print(f"appended to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
