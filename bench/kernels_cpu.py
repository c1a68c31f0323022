"""CPU kernels against the torch paths they replace, at SmolLM2-135M's shapes:

    python bench/kernels_cpu.py [--rows 1,8,64] [--layers 30]

- GGUF block linears (8-bit activations, VNNI) vs bf16 linears reordered for oneDNN;
- fused bf16 norm / rotary / SiLU-and-mul vs the torch ops of paged.model.ops.
Each figure is the best of 3 means over many calls. Results: bench/results/cpu_kernels.md.
"""

from __future__ import annotations

import argparse
import time

import torch
from common import write_results

from paged.model import ops
from paged.model.llama import rope_cache
from paged_cpu.fused_ops import fused_ops
from paged_cpu.linear import GgufBlockLinear, PackedLinear, gguf_blocks_available

# SmolLM2-135M: hidden 576, 9 query / 3 kv heads of 64, MLP 1536, vocabulary 49152
LINEARS = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}
HEAD = (576, 49152)


def timed(fn, calls: int = 30) -> float:
    """Best of 3 means, in ms."""
    fn()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls)
    return best * 1e3


def linear_pair(k: int, n: int) -> tuple[PackedLinear, GgufBlockLinear]:
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    d = torch.rand(n, k // 32) * 0.01
    m = -8 * d
    w = (codes.float().view(n, k // 32, 32) * d[..., None] + m[..., None]).view(n, k)
    return PackedLinear(w.bfloat16(), None), GgufBlockLinear(codes, d, m, None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--layers", type=int, default=30)
    args = ap.parse_args()
    torch.manual_seed(0)
    rows_out, figs = [], {}
    if gguf_blocks_available():
        pairs = {name: linear_pair(*kn) for name, kn in {**LINEARS, "lm_head": HEAD}.items()}
        for rows in (int(r) for r in args.rows.split(",")):
            total = {"dense bf16": 0.0, "GGUF blocks": 0.0}
            for name, (dense, blocks) in pairs.items():
                x = torch.randn(rows, dense.in_features).bfloat16()
                times = {
                    "dense bf16": timed(lambda: dense(x)),  # noqa: B023 (called at once)
                    "GGUF blocks": timed(lambda: blocks(x)),  # noqa: B023
                }
                per_step = 1 if name == "lm_head" else args.layers
                for key, ms in times.items():
                    total[key] += ms * per_step
                figs[f"{name} x{rows}"] = {k: round(v, 4) for k, v in times.items()}
            ratio = total["dense bf16"] / total["GGUF blocks"]
            rows_out.append(
                (
                    f"linears of one step ({args.layers} layers + head), {rows} rows",
                    f"dense bf16 {total['dense bf16']:.2f} ms, GGUF blocks "
                    f"{total['GGUF blocks']:.2f} ms ({ratio:.2f}x)",
                )
            )
            print(rows_out[-1])
    fused = fused_ops()
    if fused:
        rows = 64
        x = torch.randn(rows, 576).bfloat16()
        res = torch.randn(rows, 576).bfloat16()
        w = torch.rand(576).bfloat16()
        qkv = torch.randn(rows, 960).bfloat16()
        q, k = qkv[:, :576].view(rows, 9, 64), qkv[:, 576:768].view(rows, 3, 64)

        class Cfg:
            hidden_size, num_attention_heads, rope_theta = 576, 9, 100000.0

        cos_sin = rope_cache(Cfg(), 2048)
        pos = torch.randint(0, 2048, (rows,))
        gate_up = torch.randn(rows, 3072).bfloat16()
        cases = {
            "add + RMS norm": (
                lambda: ops.fused_add_rms_norm(x, res.clone(), w, 1e-5),
                lambda: fused["fused_add_rms_norm"](x, res.clone(), w, 1e-5),
            ),
            "rotary q, k": (
                lambda: ops.rotary_embedding(
                    pos, q, k, ops.rotary_prepare(pos, cos_sin, torch.bfloat16)
                ),
                lambda: fused["rotary_embedding"](pos, q, k, cos_sin),
            ),
            "SiLU and mul": (
                lambda: ops.silu_and_mul(gate_up),
                lambda: fused["silu_and_mul"](gate_up),
            ),
        }
        for name, (torch_op, fused_op) in cases.items():
            a, b = timed(torch_op, 200) * 1e3, timed(fused_op, 200) * 1e3
            figs[f"{name} x{rows}"] = {"torch ops us": round(a, 1), "fused us": round(b, 1)}
            rows_out.append((f"{name}, {rows} rows", f"torch ops {a:.1f} us, fused {b:.1f} us"))
            print(rows_out[-1])
    write_results("cpu_kernels.md", "CPU kernels vs the torch paths they replace", rows_out, figs)


if __name__ == "__main__":
    main()
