"""Does prefetching a projection's weight into L2 while a latency-bound kernel runs pay off?

At batch 1 a decode step reads every weight once, but the attention kernel between QKV and
o_proj reads almost nothing: HBM idles for its few microseconds. Here 32 "layers" run in one
CUDA graph, each a stand-in for that kernel (one program spinning for about as long as the
decode attention takes) followed by the o_proj-shaped GEMV on that layer's own weight (so it
comes from HBM). Variants: the spinner alone, the GEMV alone, both, and both with extra
programs beside the spinner that issue L2 prefetches of the GEMV's weight (Hopper's bulk
prefetch `cp.async.bulk.prefetch.L2`, or one `prefetch.global.L2` per 128-byte line), or with
the engine's own prefetch kernel before the spinner (paged_cuda.prefetch, what
`--cuda-l2-prefetch` launches). Kernels launch with PDL (as the engine's do on Hopper) unless
`--no-pdl`.

    python bench/l2_prefetch_gpu.py [--spin 2500] [--shapes 4096x4096,6144x4096]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "plugins" / "cuda"))
from paged.kernels import pdl  # noqa: E402
from paged_cuda.prefetch import _prefetch_kernel, bulk_prefetch  # noqa: E402


@triton.jit
def _spin_kernel(out_ptr, ITERS, w_ptr, nbytes, MODE: tl.constexpr, PIECE: tl.constexpr,
                 LANES: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """Program 0 spins (a chain of dependent FMAs); with MODE 1/2 the others prefetch."""
    pdl.enter(PDL)
    pid = tl.program_id(0)
    if pid == 0:
        x = tl.load(out_ptr + tl.arange(0, 32))
        for _ in range(ITERS):
            x = x * 0.999 + 0.001
        tl.store(out_ptr + tl.arange(0, 32), x)
    else:
        base = w_ptr.to(tl.pointer_type(tl.int8))
        lanes = ((pid - 1) * LANES + tl.arange(0, LANES)).to(tl.int64)
        if MODE == 1:
            bulk_prefetch(base, lanes * PIECE, nbytes, PIECE)
        elif MODE == 2:
            for off in range(0, PIECE, 128):
                ok = (lanes * PIECE + off < nbytes).to(tl.int32)
                tl.inline_asm_elementwise(
                    "{ .reg .pred p; setp.ne.u32 p, $2, 0; "
                    "@p prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0; }",
                    "=r,l,r", [base + lanes * PIECE + off, ok], dtype=tl.int32, is_pure=False,
                    pack=1,
                )  # fmt: skip


def chain_us(steps: list, layers: int) -> float:
    """Microseconds a layer: the steps captured in one CUDA graph (the start-up timing's
    paged_cuda.gemv_select.graph_time), over `layers` layers."""
    from paged_cuda.gemv_select import graph_time

    return graph_time(steps) * len(steps) / layers * 1e6


def bench_shape(n: int, k: int, args: argparse.Namespace, spin_buf: torch.Tensor) -> None:
    import torch.nn.functional as F

    from paged.kernels.gemv import gemv_split_k, split_k_counters

    dev, layers = spin_buf.device, args.layers
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(layers)]
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    nbytes = n * k * 2
    counters = torch.zeros(4096, dtype=torch.int32, device=dev)
    cfgs = {"cublas": None, "split(16,512,1,4)": (16, 512, 1, 4),
            "split(16,512,2,4)": (16, 512, 2, 4)}  # fmt: skip

    def lin(w, cfg):
        if cfg is None:
            return lambda: F.linear(x, w)
        assert counters.numel() >= split_k_counters(n, 1, cfg)
        return lambda: gemv_split_k(x, w, None, cfg, counters)

    def spin(w, mode, piece, lanes=128):
        progs = triton.cdiv(nbytes, lanes * piece)
        if mode == 3:  # the engine's prefetch kernel, then the spinner alone
            def both():
                _prefetch_kernel[(progs,)](w, nbytes, PIECE=piece, LANES=lanes, **pdl.launch())
                _spin_kernel[(1,)](spin_buf, args.spin, w, nbytes, MODE=0, PIECE=piece,
                                   LANES=lanes, **pdl.launch())  # fmt: skip

            return both
        grid = (1 + (progs if mode else 0),)
        return lambda: _spin_kernel[grid](spin_buf, args.spin, w, nbytes, MODE=mode,
                                          PIECE=piece, LANES=lanes, **pdl.launch())  # fmt: skip

    t_spin = chain_us([spin(w, 0, 4096) for w in ws], layers)
    print(f"{n}x{k}: spinner alone {t_spin:.2f} us a layer; the GEMV's HBM floor "
          f"{nbytes / 4.3e6:.2f} us at 4.3 TB/s")  # fmt: skip
    for name, cfg in cfgs.items():
        t_lin = chain_us([lin(w, cfg) for w in ws], layers)
        row = [f"  {name:18s} GEMV alone {t_lin:6.2f}"]
        modes = ((0, "spin+GEMV"), (1, "bulk pf"), (2, "line pf"), (3, "pf kernel"))
        for mode, label in modes:
            steps = []
            for w in ws:
                steps += [spin(w, mode, 4096 if mode == 2 else args.piece), lin(w, cfg)]
            row.append(f"{label} {chain_us(steps, layers):6.2f}")
        print(" | ".join(row) + " us a layer", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spin", type=int, default=2500, help="FMA iterations of the spinner")
    ap.add_argument("--shapes", default="4096x4096,6144x4096,4096x14336")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--piece", type=int, default=16384, help="bytes per bulk prefetch")
    ap.add_argument("--no-pdl", action="store_true", help="plain launches")
    args = ap.parse_args()
    pdl.enable(not args.no_pdl)
    spin_buf = torch.zeros(32, device="cuda")
    pdl_on = not args.no_pdl
    print(torch.cuda.get_device_name(), f"spin {args.spin}, {args.layers} layers, PDL {pdl_on}")
    for shape in args.shapes.split(","):
        n, k = map(int, shape.split("x"))
        bench_shape(n, k, args, spin_buf)


if __name__ == "__main__":
    main()
