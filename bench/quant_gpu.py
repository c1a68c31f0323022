"""Quantized weights on one GPU (issue 15), Llama-3.1-8B shape, random weights, same run:

    python bench/quant_gpu.py [--model llama-3.1-8b] [--variants none,fp8,awq]
        [--gemm-rows 1,4,16,32,64,256] [--sweep int4,int8] [--skip-gemm] [--skip-engine]
        [--gguf default|FILE|synthetic:Q4_0] [--variants gguf-blocks --gguf synthetic:Q8_0]

1. GEMMs alone (triton's do_bench_cudagraph, median): one decoder layer's four projections
   (qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down 4096x14336) at M rows, times the
   layer count (the step's linears without the head): bf16 cuBLAS (F.linear), fp8
   torch._scaled_mm with row-wise scales (activations pre-quantized, and with paged's per-token
   quantization kernel in front), paged's Triton fp8 GEMM (with its quantization), paged's
   int4_linear (AWQ/GPTQ layout, group 128: the split-K int4 GEMM below DEQUANT_MIN_ROWS, the
   weight dequantized + cuBLAS from there) and the same on GGUF Q8_0's 8-bit layout, and both
   int4 paths at every row count (the split GEMM on its default config; under 32 rows also with
   the rows' other load, gathered per code for 4-bit codes and contiguous for 8-bit ones);
   `--sweep int4,int8`: also the split GEMM on each shape's fastest config of a sweep (the
   configs listed in the results). GB/s: weight bytes over time.
2. The engine: `paged bench latency` (batch 1, 128 in / 128 out: decode ms/token) and
   `paged bench throughput` (1000 prompts, 256 in / 256 out: total tok/s) per
   `--quantization` variant (none = bf16; fp8 quantized at load; awq = int4 random weights);
   with `--gguf FILE|default` also that GGUF with its Q4 / Q8_0 blocks kept on the GPU vs dense
   (`synthetic:TYPE`: a GGUF of random TYPE blocks in --model's shape, bench/synthetic_gguf.py).
3. fp8 accuracy (the issue's floor): the default model in bf16 and with --quantization fp8,
   64 chats, 64 greedy tokens: tokens equal position by position (floor 90 %), identical
   outputs, and the fp8 engine's logprob of bf16's tokens against bf16's own (drift).

Needs CUDA (exits cleanly without it). Results: bench/results/quant-gpu.md (+ JSON twin).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "core"))

# (name, N, K) of one Llama-3.1-8B layer's projections (q/k/v and gate/up stacked)
LAYER = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
LAYERS = 32
SWEPT: list[tuple[str, str]] = []  # (shape, its fastest config and time) of --sweep


def int4_gemm_split_calls(weights: list[dict], m: int):
    """The int4 linear of m rows on the split-K tensor-core GEMM, each shape on its fastest
    config of a small sweep (what `int4_gemm_split.default_config` should pick): up to 16 rows
    one block of 16, 64 / 128 outputs, K steps of 128 / 256, SPLIT 1-8; more rows blocks of 16,
    32, 64 (and 128 from 128 rows), 64 / 128 outputs, K steps of 128, SPLIT 1-4."""
    import triton

    from paged.kernels.int4_gemm_split import int4_gemm_split

    tall = [b for b in (16, 32, 64, 128) if b <= max(64, triton.next_power_of_2(m))]
    block_ms = [16] if m <= 16 else tall

    def configs(n: int, k: int) -> list[tuple]:
        out = []
        for block_m in block_ms:
            for block_n in (64, 128):
                for block_k in (128, 256) if m <= 16 else (128,):
                    for split in (1, 2, 4, 8) if m <= 16 else (1, 2, 4):
                        per = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
                        if per * (split - 1) < k:
                            warps = 8 if block_m * block_n >= 8192 else 4
                            out.append((block_m, block_n, block_k, split, warps))
        return out

    def call(w, a, config):
        return int4_gemm_split(a, w["codes"], w["sc"], w["z"], 128, None, None, 4, config)

    return _fastest(weights, m, "codes", configs, call, "int4 split-K GEMM")


def int8_gemm_split_calls(weights: list[dict], m: int):
    """GGUF Q8_0's 8-bit linear of m rows on the split-K GEMM, each shape on its fastest config
    of a sweep (64 / 128 outputs, K steps of 16 / 32 code words, SPLIT 2-8)."""
    from paged.kernels.int4_gemm_split import int4_gemm_split

    def configs(n: int, k: int) -> list[tuple]:
        return [(16, bn, bk, split, 4) for bn in (64, 128) for bk in (64, 128)
                for split in (2, 4, 8)]  # fmt: skip

    def call(w, a, config):
        return int4_gemm_split(a, w["codes8"], w["sc8"], w["z8"], 32, None, None, 8, config)

    return _fastest(weights, m, "codes8", configs, call, "int8 split-K GEMM")


def _fastest(weights: list[dict], m: int, key: str, candidates_of, call, label: str):
    """Per weight: time call(w, x, config) for every config of candidates_of(n, k) at m rows,
    keep the fastest; returns the layer call on those."""
    from triton.testing import do_bench_cudagraph

    best = {}
    for w in weights:
        n, k = w[key].shape[0], w["k"]
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        timed = []
        for c in candidates_of(n, k):
            try:
                timed.append((do_bench_cudagraph(lambda c=c, x=x, w=w: call(w, x, c),
                                                 return_mode="median"), c))  # fmt: skip
            except Exception as e:  # noqa: BLE001 (out of resources: skip the config)
                print(f"{label} {n}x{k} {c}: {type(e).__name__}", flush=True)
        ms, best[id(w)] = min(timed)
        print(f"{label} M={m} {n}x{k}: {best[id(w)]} {ms * 1e3:.1f} us", flush=True)
        SWEPT.append((f"M={m} {label} {n}x{k}: fastest config", f"{best[id(w)]} {ms * 1e3:.1f} us"))
    return lambda w, a, aq: call(w, a, best[id(w)])


def row_loads(contiguous: bool, fn, *args):
    """fn(*args) with the int4 split GEMM loading the rows' columns contiguously (`contiguous`)
    or gathered per code, whatever int4_gemm_split.CONTIGUOUS_X_MIN_ROWS says."""
    from paged.kernels import int4_gemm_split

    before = int4_gemm_split.CONTIGUOUS_X_MIN_ROWS
    int4_gemm_split.CONTIGUOUS_X_MIN_ROWS = dict.fromkeys(before, 1 if contiguous else 1 << 30)
    try:
        return fn(*args)
    finally:
        int4_gemm_split.CONTIGUOUS_X_MIN_ROWS = before


def gemm_bench(rows: list[int], sweep: str) -> list[dict]:
    from torch.nn import functional as F
    from triton.testing import do_bench_cudagraph

    from paged.kernels.fp8_gemm import fp8_gemm, fp8_linear, quantize_fp8_rows
    from paged.kernels.int4_gemm import dequantize, int4_linear
    from paged.kernels.int4_gemm_split import int4_gemm_split
    from paged.quantization.reference import pack_int4

    dev, bf16 = "cuda", torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    weights = []
    for _, n, k in LAYER:
        w = torch.randn(n, k, device=dev, dtype=bf16, generator=gen) * 0.02
        q, s = quantize_fp8_rows(w)
        codes = pack_int4(torch.randint(0, 16, (n, k), device=dev, generator=gen))
        sc = torch.rand(n, k // 128, device=dev, generator=gen) * 0.004 + 0.002
        z = torch.full((n, k // 128), 8, dtype=torch.uint8, device=dev)
        # GGUF Q8_0's layout: 8-bit codes, a scale per 32 columns, (code - 128) * d
        codes8 = pack_int4(torch.randint(0, 256, (n, k), device=dev, generator=gen), 8)
        sc8 = torch.rand(n, k // 32, device=dev, generator=gen) * 0.0003 + 0.0001
        z8 = torch.full((n, k // 32), 128, dtype=torch.uint8, device=dev)
        # GGUF Q4_1's: 4-bit codes, a scale and a min per 32 columns, code * d + m
        sc32 = torch.rand(n, k // 32, device=dev, generator=gen) * 0.004 + 0.002
        z32 = torch.zeros((n, k // 32), dtype=torch.uint8, device=dev)
        m32 = torch.randn(n, k // 32, device=dev, generator=gen) * 0.01
        weights.append(dict(w=w, q=q, s=s, codes=codes, sc=sc, z=z, codes8=codes8, sc8=sc8,
                            z8=z8, sc32=sc32, z32=z32, m32=m32, k=k))  # fmt: skip
    layer_bytes = {"bf16": sum(2 * n * k for _, n, k in LAYER)}
    layer_bytes["fp8"] = layer_bytes["bf16"] // 2
    layer_bytes["int4"] = sum(n * k // 2 + n * (k // 128) * 5 for _, n, k in LAYER)
    layer_bytes["int8"] = sum(n * k + n * (k // 32) * 5 for _, n, k in LAYER)
    scaled_mm = hasattr(torch, "_scaled_mm") and torch.cuda.get_device_capability() >= (8, 9)
    out = []
    for m in rows:
        x = {w["k"]: torch.randn(m, w["k"], device=dev, dtype=bf16, generator=gen)
             for w in weights}  # fmt: skip
        xq = {k: quantize_fp8_rows(v) for k, v in x.items()}

        def layer(fn, x=x, xq=xq):
            return lambda: [fn(w, x[w["k"]], xq[w["k"]]) for w in weights]

        variants = {
            "bf16 cuBLAS": ("bf16", layer(lambda w, a, aq: torch.nn.functional.linear(a, w["w"]))),
            "fp8 Triton (+quant)": ("fp8", layer(lambda w, a, aq: fp8_linear(a, w["q"], w["s"],
                                                                             w["k"]))),
            "fp8 Triton GEMM only": ("fp8", layer(lambda w, a, aq: fp8_gemm(
                aq[0], aq[1], w["q"], w["s"], w["k"], None, bf16))),
            "int4_linear (group 128)": ("int4", layer(lambda w, a, aq: int4_linear(
                a, w["codes"], w["sc"], w["z"], 128))),
            "int8_linear (GGUF Q8_0)": ("int8", layer(lambda w, a, aq: int4_linear(
                a, w["codes8"], w["sc8"], w["z8"], 32, None, None, 8))),
        }  # fmt: skip
        variants["int4 split-K GEMM (default)"] = ("int4", layer(lambda w, a, aq: int4_gemm_split(
            a, w["codes"], w["sc"], w["z"], 128, None, None, 4)))  # fmt: skip
        if m < 32:  # the rows' columns gathered per code (the default until 2026-12-06)
            variants["int4 split-K GEMM (default), rows gathered"] = ("int4", layer(
                lambda w, a, aq: row_loads(False, int4_gemm_split, a, w["codes"], w["sc"], w["z"],
                                           128, None, None, 4)))  # fmt: skip
        variants["int4 dequantized + cuBLAS"] = ("int4", layer(lambda w, a, aq: F.linear(
            a, dequantize(w["codes"], w["sc"], w["z"], 128, None, 4, bf16))))  # fmt: skip
        if 5 <= m < 32:
            variants["int8 split-K GEMM (default), rows gathered"] = ("int8", layer(
                lambda w, a, aq: row_loads(False, int4_gemm_split, a, w["codes8"], w["sc8"],
                                           w["z8"], 32, None, None, 8)))  # fmt: skip
        variants["int8 split-K GEMM (default)"] = ("int8", layer(lambda w, a, aq: int4_gemm_split(
            a, w["codes8"], w["sc8"], w["z8"], 32, None, None, 8)))  # fmt: skip
        if m < 5:
            variants["int8 split-K GEMM (default), rows contiguous"] = ("int8", layer(
                lambda w, a, aq: row_loads(True, int4_gemm_split, a, w["codes8"], w["sc8"],
                                           w["z8"], 32, None, None, 8)))  # fmt: skip
        variants["int8 dequantized + cuBLAS"] = ("int8", layer(lambda w, a, aq: F.linear(
            a, dequantize(w["codes8"], w["sc8"], w["z8"], 32, None, 8, bf16))))  # fmt: skip
        variants["int4 GGUF Q4_1 (group 32, mins)"] = ("int4", layer(lambda w, a, aq: int4_linear(
            a, w["codes"], w["sc32"], w["z32"], 32, None, w["m32"])))  # fmt: skip
        variants["int4 GGUF Q4_1 split-K GEMM (default)"] = ("int4", layer(
            lambda w, a, aq: int4_gemm_split(a, w["codes"], w["sc32"], w["z32"], 32, None,
                                             w["m32"], 4)))  # fmt: skip
        if m < 32:
            variants["int4 GGUF Q4_1 split-K GEMM (default), rows gathered"] = ("int4", layer(
                lambda w, a, aq: row_loads(False, int4_gemm_split, a, w["codes"], w["sc32"],
                                           w["z32"], 32, None, w["m32"], 4)))  # fmt: skip
        variants["int4 GGUF Q4_1 dequantized + cuBLAS"] = ("int4", layer(
            lambda w, a, aq: F.linear(a, dequantize(w["codes"], w["sc32"], w["z32"], 32, w["m32"],
                                                    4, bf16))))  # fmt: skip
        if "int8" in sweep and m == 1:
            variants["int8 split-K GEMM (best/shape)"] = (
                "int8",
                layer(int8_gemm_split_calls(weights, m)),
            )
        if "int4" in sweep:
            variants["int4 split-K GEMM (best/shape)"] = (
                "int4",
                layer(int4_gemm_split_calls(weights, m)),
            )
        if scaled_mm:
            from paged_cuda.fp8 import fp8_linear as cuda_fp8

            def mm(w, a, aq):
                return torch._scaled_mm(aq[0], w["q"].t(), scale_a=aq[1],
                                        scale_b=w["s"].view(1, -1), out_dtype=bf16)  # fmt: skip

            variants["fp8 _scaled_mm only"] = ("fp8", layer(mm))
            variants["fp8 _scaled_mm (+quant)"] = (
                "fp8", layer(lambda w, a, aq: cuda_fp8(a, w["q"], w["s"], w["k"])))  # fmt: skip
        for name, (kind, fn) in variants.items():
            ms = do_bench_cudagraph(fn, return_mode="median")
            step = ms * LAYERS
            gbs = layer_bytes[kind] / ms / 1e6
            out.append(dict(rows=m, variant=name, layer_ms=ms, step_ms=step, gb_per_s=gbs))
            print(f"M={m:<4} {name:<26} layer {ms * 1e3:8.1f} us  x{LAYERS} = {step:6.2f} ms "
                  f"{gbs:7.0f} GB/s", flush=True)  # fmt: skip
    return out


def paged_cmd(*args: object) -> list[str]:
    return [sys.executable, "-m", "paged.cli.main", *map(str, args)]


def engine_bench(args, variant: str, out: Path) -> dict:
    base = ["--model", args.model, "--load-format", "dummy", "--dtype", "bfloat16"]
    if variant.startswith("gguf"):  # a real GGUF file: its blocks kept 4- / 8-bit, or dense
        base = ["--model", args.gguf, "--dtype", "bfloat16"]
        base += [] if variant == "gguf-blocks" else ["--no-cuda-gguf-blocks"]
    elif variant != "none":
        base += ["--quantization", variant]
    base += shlex.split(args.engine_args)
    res: dict = {"variant": variant, "commands": []}
    lat, tp = out / f"latency-{variant}.json", out / f"throughput-{variant}.json"
    cmds = {
        "latency": paged_cmd("bench", "latency", *base, "--batch-size", 1, "--input-len",
                             args.lat_input, "--output-len", args.lat_output,
                             "--no-enable-prefix-caching", "--num-iters-warmup", 1,
                             "--num-iters", args.lat_iters, "--save-json", lat,
                             "--disable-tqdm"),
        "throughput": paged_cmd("bench", "throughput", *base, "--num-prompts", args.tp_prompts,
                                "--input-len", args.tp_input, "--output-len", args.tp_output,
                                "--save-json", tp, "--disable-tqdm"),
    }  # fmt: skip
    for name, cmd in cmds.items():
        res["commands"].append(shlex.join(cmd))
        print(f"$ {shlex.join(cmd)}", flush=True)
        try:
            p = subprocess.run(cmd, timeout=args.timeout, capture_output=True, text=True,
                               cwd=ROOT)  # fmt: skip
            if p.returncode:
                res[f"{name}_error"] = (p.stdout + p.stderr)[-2000:]
                print(res[f"{name}_error"], flush=True)
        except subprocess.TimeoutExpired:
            res[f"{name}_error"] = f"timed out after {args.timeout} s"
        path = lat if name == "latency" else tp
        if path.is_file():  # printed now: a run cut short keeps what it measured
            res[name] = json.loads(path.read_text())
            key = "mean_tpot_ms" if name == "latency" else "total_tokens_per_s"
            print(f"{variant} {name}: {key} {res[name].get(key)}", flush=True)
    return res


def accuracy_child(model: str, variant: str, n: int, tokens: int, ref: str | None, out: str):
    """One engine (bf16, or fp8 at load): greedy chat outputs, and the logprob this engine
    gives each token of the bf16 outputs (`ref`: the bf16 child's file; None: its own)."""
    from common import chat_prompts

    from paged import LLM, SamplingParams
    from paged.config import platform_options

    quant = None if variant in ("none", "float32") else variant
    dtype = "float32" if variant == "float32" else "bfloat16"
    # bf16 is the dense model: a GGUF's blocks are not kept 4-bit / 8-bit on any platform
    dense = {k: False for k in ("cuda_gguf_blocks", "cpu_gguf_blocks") if k in platform_options()}
    llm = LLM(model, dtype=dtype, quantization=quant, max_model_len=2048, **dense)
    greedy = SamplingParams(temperature=0, max_tokens=tokens)
    outs = llm.chat(chat_prompts(n), greedy, use_tqdm=False)
    res = {"tokens": [o.outputs[0].token_ids for o in outs]}
    if ref is None:
        res["prompts"] = [o.prompt_token_ids for o in outs]
        seqs = [(p, t) for p, t in zip(res["prompts"], res["tokens"])]
    else:
        base = json.loads(Path(ref).read_text())
        seqs = list(zip(base["prompts"], base["tokens"]))
    score = SamplingParams(max_tokens=1, prompt_logprobs=1)
    scored = llm.generate([{"prompt_token_ids": p + t} for p, t in seqs], score, use_tqdm=False)
    res["logprobs"] = [
        [e[tok].logprob for tok, e in zip(t, o.prompt_logprobs[len(p):])]
        for (p, t), o in zip(seqs, scored)
    ]  # fmt: skip
    res["ranks"] = [  # 1: this engine's own greedy choice after the same prefix
        [e[tok].rank for tok, e in zip(t, o.prompt_logprobs[len(p):])]
        for (p, t), o in zip(seqs, scored)
    ]  # fmt: skip
    Path(out).write_text(json.dumps(res))


def accuracy(args, out: Path) -> dict:
    """fp8 at load against bf16 on the same model: greedy tokens that agree (position by
    position, free-running), prompts whose output is identical, bf16's tokens that are fp8's
    own greedy choice after bf16's prefix (teacher-forced), and the logprob drift on bf16's
    tokens. The same figures for float32 against bf16 say how far bf16 itself is from the
    model's exact arithmetic on this model (the scale of the first ones)."""
    files, cmds = {}, []
    for v in ("none", "fp8", "float32"):
        files[v] = out / f"accuracy-{v}.json"
        cmd = [sys.executable, __file__, "--_accuracy", v, str(files[v]), "--acc-model",
               args.acc_model, "--acc-prompts", str(args.acc_prompts), "--acc-tokens",
               str(args.acc_tokens)]  # fmt: skip
        if v != "none":
            cmd += ["--_accuracy-ref", str(files["none"])]
        cmds.append(shlex.join(cmd))
        print(f"$ {cmds[-1]}", flush=True)
        p = subprocess.run(cmd, timeout=args.timeout, capture_output=True, text=True, cwd=ROOT)
        if p.returncode:
            return {"error": (p.stdout + p.stderr)[-2000:], "commands": cmds}
    base = json.loads(files["none"].read_text())
    res = dict(model=args.acc_model, prompts=len(base["tokens"]), commands=cmds)
    for v in ("fp8", "float32"):
        res[v] = agreement(base, json.loads(files[v].read_text()))
    return res


def agreement(a: dict, b: dict) -> dict:
    """How engine b's outputs and scores agree with engine a's (the bf16 reference)."""
    same = total = identical = 0
    for x, y in zip(a["tokens"], b["tokens"]):
        n = max(len(x), len(y))
        same += sum(i < len(x) and i < len(y) and x[i] == y[i] for i in range(n))
        total += n
        identical += x == y
    drift = [abs(p - q) for u, v in zip(a["logprobs"], b["logprobs"]) for p, q in zip(u, v)]
    ranks = [r for row in b["ranks"] for r in row]
    return dict(token_match=same / max(total, 1), identical_outputs=identical,
                teacher_forced_top1=sum(r == 1 for r in ranks) / max(len(ranks), 1),
                mean_logprob_drift=sum(drift) / max(len(drift), 1),
                max_logprob_drift=max(drift, default=0.0))  # fmt: skip


def _f(v, fmt: str = ".2f") -> str:
    return "-" if v is None else format(v, fmt)


def report(gemms: list[dict], engine: list[dict], args, acc: dict | None = None) -> str:
    lines = []
    if acc and "fp8" in acc:
        ok = "met" if acc["fp8"]["token_match"] >= 0.9 else "NOT met"
        lines += [f"\n### fp8 accuracy: {acc['model']}, {acc['prompts']} chats, greedy\n",
                  f"- fp8 tokens equal to bf16's, position by position: "
                  f"{acc['fp8']['token_match']:.1%} "
                  f"(floor 90 %: {ok})", "",
                  "| against bf16 | tokens equal, free-running | identical outputs | "
                  "bf16's token is its greedy choice (teacher-forced) | logprob drift mean / "
                  "max (nats) |", "|---|---|---|---|---|"]  # fmt: skip
        for v in ("fp8", "float32"):
            a = acc[v]
            lines.append(
                f"| {v} | {a['token_match']:.1%} | {a['identical_outputs']} "
                f"| {a['teacher_forced_top1']:.1%} "
                f"| {a['mean_logprob_drift']:.4f} / {a['max_logprob_drift']:.3f} |"
            )
    elif acc:
        lines += ["\n### fp8 accuracy: failed\n", "```", acc.get("error", "")[-1500:], "```"]
    if gemms:
        lines += [f"\n### GEMMs of one step ({LAYERS} layers x qkv/o/gate_up/down), median\n",
                  "| M | variant | one layer us | step ms | weight GB/s |",
                  "|---|---|---|---|---|"]  # fmt: skip
        for g in gemms:
            lines.append(f"| {g['rows']} | {g['variant']} | {g['layer_ms'] * 1e3:.1f} "
                         f"| {g['step_ms']:.2f} | {g['gb_per_s']:.0f} |")  # fmt: skip
    if engine:
        lines += [f"\n### Engine, {args.model}, dummy weights: batch 1 ({args.lat_input} in / "
                  f"{args.lat_output} out) and {args.tp_prompts} x {args.tp_input}/{args.tp_output}"
                  "\n", "| --quantization | decode ms/token | TTFT ms | total tok/s | "
                  "output tok/s |", "|---|---|---|---|---|"]  # fmt: skip
        for e in engine:
            lat, tp = e.get("latency", {}), e.get("throughput", {})
            err = "; ".join(k for k in e if k.endswith("_error"))
            lines.append(f"| {e['variant']}{' (' + err + ')' if err else ''} "
                         f"| {_f(lat.get('mean_tpot_ms'))} | {_f(lat.get('mean_ttft_ms'), '.1f')} "
                         f"| {_f(tp.get('total_tokens_per_s'), '.0f')} "
                         f"| {_f(tp.get('output_tokens_per_s'), '.0f')} |")  # fmt: skip
        lines += ["", "commands:"] + [f"- `{c}`" for e in engine for c in e["commands"]]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a = ap.add_argument
    a("--model", default="llama-3.1-8b", help="a named shape (dummy weights)")
    a("--variants", default="none,fp8,awq", help="--quantization values; none = bf16")
    a("--gemm-rows", default="1,4,16,32,64,256")
    a("--skip-gemm", action="store_true")
    a(
        "--sweep",
        default="",
        help="int4,int8: also the split GEMM's best config per shape of a sweep (int8: at one row)",
    )
    a("--skip-engine", action="store_true")
    a("--lat-input", type=int, default=128)
    a("--lat-output", type=int, default=128)
    a("--lat-iters", type=int, default=3)
    a("--tp-prompts", type=int, default=1000)
    a("--tp-input", type=int, default=256)
    a("--tp-output", type=int, default=256)
    a(
        "--gguf",
        default=None,
        help="also a GGUF file with Q4_0/Q4_1/Q8_0/K-quant tensors: its blocks on the GPU "
        "(variant gguf-blocks) vs dense (gguf-dense; both unless --variants names one); "
        "'default': the default model; 'synthetic:Q4_0' (Q4_1, Q8_0, Q4_K, Q6_K, Q4_K_M): "
        "random blocks in --model's shape, written by bench/synthetic_gguf.py",
    )
    a("--engine-args", default="", help="extra engine flags, e.g. '--kv-cache-dtype fp8'")
    a("--timeout", type=float, default=900)
    a("--skip-accuracy", action="store_true")
    a(
        "--acc-model",
        default="default",
        help="model of the fp8 accuracy check (default: the default model, SmolLM2-135M-Instruct)",
    )
    a("--acc-prompts", type=int, default=64)
    a("--acc-tokens", type=int, default=64)
    a("--_accuracy", nargs=2, default=None, help=argparse.SUPPRESS)  # child: variant, out
    a("--_accuracy-ref", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.acc_model == "default" and not args.skip_accuracy:
        from paged.model.loader import default_model_path

        args.acc_model = default_model_path()
    if args._accuracy:
        variant, out = args._accuracy
        accuracy_child(args.acc_model, variant, args.acc_prompts, args.acc_tokens,
                       args._accuracy_ref, out)  # fmt: skip
        return 0
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 0
    from common import write_results

    if args.gguf == "default":
        from paged.model.loader import default_model_path

        args.gguf = default_model_path()
    elif args.gguf and args.gguf.startswith("synthetic:"):
        from synthetic_gguf import write

        kind = args.gguf.split(":", 1)[1].upper()
        path = Path(tempfile.gettempdir()) / f"{args.model}-synthetic-{kind.lower()}.gguf"
        args.gguf = str(write(args.model, kind, str(path)))

    gemms = (
        []
        if args.skip_gemm
        else gemm_bench([int(r) for r in args.gemm_rows.split(",")], args.sweep)
    )
    engine, acc = [], None
    if not args.skip_accuracy:
        with tempfile.TemporaryDirectory() as tmp:
            acc = accuracy(args, Path(tmp))
    if not args.skip_engine:
        with tempfile.TemporaryDirectory() as tmp:
            variants = args.variants.split(",")
            if args.gguf and not any(v.startswith("gguf") for v in variants):
                variants += ["gguf-blocks", "gguf-dense"]
            for v in variants:
                engine.append(engine_bench(args, v, Path(tmp)))
    text = report(gemms, engine, args, acc)
    print(text)
    rows = [(f"M={g['rows']} {g['variant']}", f"step {g['step_ms']:.2f} ms, "
             f"{g['gb_per_s']:.0f} GB/s") for g in gemms] + SWEPT  # fmt: skip
    for e in engine:
        lat, tp = e.get("latency", {}), e.get("throughput", {})
        rows.append((f"--quantization {e['variant']}",
                     f"decode {_f(lat.get('mean_tpot_ms'))} ms/token, "
                     f"{_f(tp.get('total_tokens_per_s'), '.0f')} total tok/s"))  # fmt: skip
    if acc and "fp8" in acc:
        rows.append(("fp8 vs bf16 greedy tokens", f"{acc['fp8']['token_match']:.1%} equal, "
                     f"logprob drift mean {acc['fp8']['mean_logprob_drift']:.4f}"))  # fmt: skip
    write_results("quant-gpu.md", f"Quantized weights, {args.model}", rows,
                  {"gemms": gemms, "engine": engine, "accuracy": acc, "report": text})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
