"""Does the o_proj GEMV hide the decode attention before it? At batch 1, between the QKV and
o_proj GEMVs the attention kernel reads almost nothing and HBM idles (bench/results/h200.md:
about 5 us a layer on an H200). Launched with PDL, o_proj's programs may start while the
attention runs and load weight tiles before they wait for its output, so a GEMV config can
hide some of the attention; start-up timing (paged_cuda.gemv_select / fp8_select) times each
config with nothing before it, so it cannot see that.

For Llama-3.1-8B's o_proj (4096 x 4096) in a CUDA graph over 32 layers (a weight, a KV cache
per layer; 32 query heads, 8 KV heads, head 128; the attention as the engine launches it at
batch 1: rotary and K/V write inside, splits merged by the last one), per config: the GEMV
alone, the attention then the GEMV, and `hidden` = attention alone + GEMV alone - both, in us
a layer; and the same with a spinner as long as the attention, reading nothing, in its
place (`hidden (spin)`: whether start-up timing could stand one in for the attention).
bf16: cuBLAS, gemv_select's candidates and wider tiles (a slice of K in one or two BLOCK_K
steps: more of a program's weight loaded before its wait); fp8: the unsplit tensor-core GEMV
and fp8_select's split candidates.

    python bench/attention_then_gemv_gpu.py [--ctx 192] [--kinds bf16,fp8] [--no-pdl]
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

H, HKV, D, BS, LAYERS, N = 32, 8, 128, 16, 32, 4096


@triton.jit
def _spin_kernel(ns, PDL: tl.constexpr):
    """A stand-in for the attention: each program waits for the kernel before it, lets the next
    start launching (as the attention does), then spins `ns` nanoseconds reading nothing."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    start = tl.extra.cuda.globaltimer()
    while tl.extra.cuda.globaltimer() - start < ns:
        pass


def spinner_calls(ns: int, programs: int) -> list:
    """One spin a layer, on as many programs as the attention's grid."""
    from paged.kernels import pdl

    return [lambda: _spin_kernel[(programs,)](ns, **pdl.launch())] * LAYERS


def us_per_layer(calls) -> float:
    """Median microseconds per layer of the calls (one a layer) in one CUDA graph."""
    from triton.testing import do_bench_cudagraph

    ms = do_bench_cudagraph(lambda: [c() for c in calls], rep=50, return_mode="median")
    return ms * 1e3 / len(calls)


def attention_calls(ctx: int, gen: torch.Generator) -> tuple[list, torch.Tensor]:
    """One decode attention a layer over that layer's cache, and the output they all write."""
    from paged.kernels import decode as dec
    from paged.kernels import paged_attention_decode

    per_seq = -(-(ctx + 1) // BS)
    caches = [torch.randn(2, per_seq, BS, HKV, D, device="cuda", dtype=torch.bfloat16,
                          generator=gen) for _ in range(LAYERS)]  # fmt: skip
    table = torch.arange(per_seq, device="cuda", dtype=torch.int32).view(1, per_seq)
    seq = torch.full((1,), ctx + 1, dtype=torch.int32, device="cuda")
    slots = torch.full((1,), ctx, dtype=torch.int64, device="cuda")
    q = torch.randn(1, H, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    kv = torch.randn(1, 2 * HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    out = torch.empty(1, H, D, device="cuda", dtype=torch.bfloat16)
    pos = torch.full((1,), ctx, dtype=torch.int64, device="cuda")
    cos_sin = torch.randn(8192, D, device="cuda")
    splits = dec.MAX_SPLITS  # as captured for a graph whose max length is the model's
    ws = dec.decode_workspace(1, H, D, splits, "cuda")
    counters = dec.decode_counters(1, HKV, "cuda")

    def attn(c: torch.Tensor) -> None:
        paged_attention_decode(q, c[0], c[1], out, seq, table, D**-0.5, 8192, splits, ws,
                               counters=counters, key=kv[:, :HKV], value=kv[:, HKV:],
                               slot_mapping=slots, rotary=(pos, cos_sin))  # fmt: skip

    return [lambda c=c: attn(c) for c in caches], out.view(1, H * D)


def gemv_configs(kind: str, weights: list, x: torch.Tensor) -> dict[str, list]:
    """{label: one call a layer} for each config of the kind's decode GEMVs."""
    from paged.kernels.fp8_gemv import fp8_gemv_split
    from paged.kernels.gemv import dot_config, fp8_gemv_dot, gemv_split_k
    from paged_cuda import fp8_select, gemv_select

    counters = torch.zeros(4 * N, dtype=torch.int32, device="cuda")
    if kind == "bf16":
        out = {"cuBLAS": [lambda w=w: torch.nn.functional.linear(x, w) for w in weights]}
        whole = [(bn, bk, split, 4) for bn in (8, 16, 32) for bk in (512, 1024)
                 for split in (2, 4, 8) if bn * bk <= 8192 and N // split >= bk]  # fmt: skip
        for c in dict.fromkeys([*gemv_select.candidates(N, N), *whole]):
            out[f"gemv {c}"] = [lambda w=w, c=c: gemv_split_k(x, w, None, c, counters)
                                for w in weights]  # fmt: skip
        return out
    sms, smem = fp8_select.device_limits(x.device)
    bn, bk, warps, stages = dot_config(N, N, x.device)
    out = {"unsplit": [lambda a=a, s=s: fp8_gemv_dot(x, a, s) for a, s in weights]}
    tiles = [(bn, bk, 1, warps, stages), *fp8_select.one_slice(N, N, sms, smem),
             *fp8_select.candidates(N, N, sms, smem)]
    for c in dict.fromkeys(tiles):
        out[f"split {c}"] = [lambda a=a, s=s, c=c: fp8_gemv_split(x, a, s, None, c, counters)
                             for a, s in weights]  # fmt: skip
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", type=int, default=192, help="cached tokens before the step's own")
    ap.add_argument("--kinds", default="bf16,fp8")
    ap.add_argument("--no-pdl", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/attention_then_gemv_gpu.py: no CUDA device, skipping")
        return 0
    from paged.kernels import pdl
    from paged.kernels.compile_ahead import compile_ahead
    from paged.kernels.fp8_gemm import quantize_fp8_rows

    pdl.enable(not args.no_pdl and torch.cuda.get_device_capability()[0] >= 9)
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, ctx {args.ctx}, PDL {'off' if args.no_pdl else 'on'},"
          " us a layer (medians over 32 layers in a CUDA graph)", flush=True)  # fmt: skip
    with torch.inference_mode():
        attn, x = attention_calls(args.ctx, gen)
        t_attn = us_per_layer(attn)
        from paged.kernels.decode import MAX_SPLITS

        spin = spinner_calls(int(t_attn * 1e3), HKV * MAX_SPLITS)
        t_spin = us_per_layer(spin)
        print(f"attention alone {t_attn:.2f}; spinner alone {t_spin:.2f}", flush=True)
        bf16 = [torch.randn(N, N, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
                for _ in range(LAYERS)]  # fmt: skip
        for kind in args.kinds.split(","):
            weights = bf16 if kind == "bf16" else [quantize_fp8_rows(w) for w in bf16]
            configs = gemv_configs(kind, weights, x)
            failed, secs = compile_ahead([calls[0] for calls in configs.values()])
            print(f"{kind}: {len(configs)} configs compiled in {secs:.1f} s", flush=True)
            rows = []
            for label, calls in configs.items():
                try:
                    alone = us_per_layer(calls)
                    both = us_per_layer([f for pair in zip(attn, calls) for f in pair]) * 2
                    spun = us_per_layer([f for pair in zip(spin, calls) for f in pair]) * 2
                except triton.runtime.errors.OutOfResources:
                    continue
                rows.append((both, label, alone, spun))
            rows.sort()
            print(f"{kind}: config, GEMV alone, attention + GEMV, hidden, spinner + GEMV, "
                  "hidden (spin)", flush=True)  # fmt: skip
            for both, label, alone, spun in rows:
                print(f"  {label:34s} {alone:6.2f} {both:6.2f} {t_attn + alone - both:6.2f} "
                      f"{spun:6.2f} {t_spin + alone - spun:6.2f}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
