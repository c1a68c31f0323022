"""Per-token fp8 quantization of activations (quantize_fp8_rows, before every fp8 GEMM) on a
GPU: the one-pass kernel (a row read once when it fits one block) against the two-pass launch
(absmax, then quantize, 1024-value blocks), bit-identical outputs checked.

    python bench/fp8_activations.py [--shapes 1x4096,512x4096,512x14336,8192x4096,8192x14336]

Prints us and GB/s (bf16 read + fp8 written) per shape. Needs CUDA.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1x4096,512x4096,512x14336,8192x4096,8192x14336")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA")
        return
    from triton.testing import do_bench_cudagraph

    from paged.kernels import fp8_gemm

    for shape in args.shapes.split(","):
        m, k = map(int, shape.split("x"))
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device="cuda")
        s = torch.empty(m, 1, device="cuda")

        two_pass = partial(fp8_gemm._quant_rows[(m,)], x, q, s, k, x.stride(0), q.stride(0),
                           BLOCK=1024, ONE_PASS=False, num_warps=4)  # fmt: skip
        two_pass()
        one, _ = fp8_gemm.quantize_fp8_rows(x)
        assert torch.equal(one.view(torch.uint8), q.view(torch.uint8))
        t2 = do_bench_cudagraph(two_pass, return_mode="median")
        t1 = do_bench_cudagraph(partial(fp8_gemm.quantize_fp8_rows, x), return_mode="median")
        gb = m * k * 3 / 1e9
        print(f"{m}x{k}: two-pass {t2 * 1e3:7.1f} us ({gb / t2 * 1e3:5.0f} GB/s), one-pass "
              f"{t1 * 1e3:7.1f} us ({gb / t1 * 1e3:5.0f} GB/s)", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
