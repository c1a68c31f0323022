"""The fp8 KV cache on one GPU (issue 15), Llama-3.1-8B shape, random weights, same run:

    python bench/kv_fp8_gpu.py [--contexts 1024,8192,32768] [--tokens 262144]
        [--engine-args "--kv-cache-memory 16GiB"] [--skip-kernels] [--skip-engine]

1. Kernels (triton's do_bench_cudagraph, median, one layer): split-K decode attention over a
   bf16 cache and over an fp8 (e4m3) cache (read as fp16; also as bf16) at each context
   length, the batch sized so that batch x context = --tokens (the same KV token count at
   every length: 256 x 1k, 32 x 8k, 8 x 32k); GB/s is the cache bytes read over the time.
   Also the cache write (reshape_and_cache of 256 tokens) and one 2048-token prefill chunk
   over a context of that length (varlen), bf16 vs fp8. Max abs error of the fp8 outputs
   against the bf16 ones is printed (the cache's own rounding, about 2^-4 relative per
   element, not a kernel error: the CPU tests check that).
2. Accuracy (any device; --accuracy-only runs just this, e.g. on CPU): the default model
   (SmolLM2-135M-Instruct) in --accuracy-dtype, --acc-prompts chat prompts, greedy
   --acc-tokens tokens with --kv-cache-dtype auto and fp8: the share of generated tokens equal
   to auto's up to each prompt's first difference (and prompts identical throughout), and the
   logprob drift of the chosen tokens over that common prefix (mean and max |fp8 - auto|).
3. The engine: `paged bench throughput` (--num-prompts prompts, --input-len in / --output-len
   out, dummy weights) with --kv-cache-dtype auto and fp8 under the same --kv-cache-memory: the
   fp8 run holds twice the blocks, so more sequences decode at once at long contexts.

Needs CUDA (exits cleanly without it). Results: bench/results/kv-fp8-gpu.md (+ JSON twin).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "core"))

H, HKV, D, BS = 32, 8, 128, 16  # Llama-3.1-8B attention
FP8 = torch.float8_e4m3fn


def cache(gen: torch.Generator, blocks: int, dtype: torch.dtype) -> torch.Tensor:
    kv = torch.randn(2, blocks, BS, HKV, D, device="cuda", generator=gen, dtype=torch.bfloat16)
    return kv if dtype == torch.bfloat16 else kv.to(dtype)  # scale 1.0: |x| << 448


def kernel_bench(contexts: list[int], tokens: int, tiles: list[tuple[int, int, int]]) -> list[dict]:
    from triton.testing import do_bench_cudagraph

    from paged.kernels import (
        decode_workspace,
        paged_attention_decode,
        paged_attention_varlen,
        reshape_and_cache,
    )
    from paged.kernels.decode import MAX_SPLITS, choose_num_splits, decode_counters

    gen = torch.Generator(device="cuda").manual_seed(0)
    ones = torch.ones(HKV, device="cuda")
    scales = {torch.bfloat16: {}, FP8: {"k_scale": ones, "v_scale": ones}}
    rows: list[dict] = []

    def record(kind: str, shape: str, times: dict, nbytes: dict, err: float) -> None:
        bf, f8 = times[torch.bfloat16], times[FP8]
        row = {"kernel": kind, "shape": shape, "bf16_us": bf * 1e3, "fp8_us": f8 * 1e3,
               "speedup": bf / f8, "max_abs_err": err}  # fmt: skip
        if nbytes:
            row["bf16_GBps"] = nbytes[torch.bfloat16] / bf / 1e6
            row["fp8_GBps"] = nbytes[FP8] / f8 / 1e6
        rows.append(row)
        gbps = f"{row['bf16_GBps']:6.0f} / {row['fp8_GBps']:6.0f} GB/s" if nbytes else ""
        print(f"{kind:<8}{shape:<26}bf16 {bf * 1e3:9.1f} us  fp8 {f8 * 1e3:9.1f} us  "
              f"{bf / f8:5.2f}x  {gbps}  err {err:.2e}", flush=True)  # fmt: skip

    for ctx in contexts:
        batch = max(1, tokens // ctx)
        per_seq = -(-ctx // BS)
        table = torch.randperm(batch * per_seq, device="cuda", generator=gen).int()
        table = table.view(batch, per_seq)
        seq = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        q = torch.randn(batch, H, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        splits = choose_num_splits(batch, HKV, ctx)
        ws = decode_workspace(batch, H, D, MAX_SPLITS, "cuda")
        tickets = {"counters": decode_counters(batch, HKV, "cuda")}  # as the backend keeps them
        times, nbytes, outs = {}, {}, {}
        base = cache(gen, batch * per_seq, torch.bfloat16)
        for dt in (torch.bfloat16, FP8):
            kv = base if dt == torch.bfloat16 else base.to(dt)
            out = torch.empty_like(q)
            run = partial(paged_attention_decode, q, kv[0], kv[1], out, seq, table, D**-0.5,
                          ctx, splits, ws, **tickets, **scales[dt])  # fmt: skip
            run()
            outs[dt] = out.float()
            times[dt] = do_bench_cudagraph(run, return_mode="median")
            nbytes[dt] = 2 * batch * ctx * HKV * D * kv.element_size()
        err = (outs[FP8] - outs[torch.bfloat16]).abs().max().item()
        record("decode", f"B={batch} ctx={ctx} splits={splits}", times, nbytes, err)
        # the fp8 cache converted to bf16 instead of fp16 (the default before 85335bc)
        kv8 = base.to(FP8)
        run = partial(paged_attention_decode, q, kv8[0], kv8[1], torch.empty_like(q), seq, table,
                      D**-0.5, ctx, splits, ws, f16=False, **tickets, **scales[FP8])  # fmt: skip
        ms = do_bench_cudagraph(run, return_mode="median")
        rows.append({"kernel": "decode-fp8-as-bf16", "shape": f"B={batch} ctx={ctx}",
                     "fp8_us": ms * 1e3})  # fmt: skip
        print(f"  fp8 read as bf16: {ms * 1e3:9.1f} us ({nbytes[FP8] / ms / 1e6:6.0f} GB/s)",
              flush=True)  # fmt: skip
        for bn, warps, stages in tiles:  # fp8 launch tiles to try against the defaults
            kv8 = base.to(FP8)
            run = partial(paged_attention_decode, q, kv8[0], kv8[1], torch.empty_like(q), seq,
                          table, D**-0.5, ctx, splits, ws, block_n=bn, num_warps=warps,
                          num_stages=stages, **tickets, **scales[FP8])  # fmt: skip
            ms = do_bench_cudagraph(run, return_mode="median")
            rows.append({"kernel": "decode-fp8-tiles", "shape": f"B={batch} ctx={ctx}",
                         "block_n": bn, "num_warps": warps, "num_stages": stages,
                         "fp8_us": ms * 1e3})  # fmt: skip
            print(f"  fp8 block_n={bn} warps={warps} stages={stages}: {ms * 1e3:9.1f} us "
                  f"({nbytes[FP8] / ms / 1e6:6.0f} GB/s)", flush=True)  # fmt: skip

    n = 256  # cache write of one decode step's tokens
    k = torch.randn(n, HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    slots = torch.randperm(n * 8, device="cuda", generator=gen)[:n]
    times, nbytes = {}, {}
    for dt in (torch.bfloat16, FP8):
        kv = torch.zeros(2, n * 8 // BS, BS, HKV, D, device="cuda", dtype=dt)
        write = partial(reshape_and_cache, k, k, kv[0], kv[1], slots, **scales[dt])
        times[dt] = do_bench_cudagraph(write, return_mode="median")
        nbytes[dt] = 2 * n * HKV * D * (2 + kv.element_size())  # read bf16, write cache
    record("write", f"T={n}", times, nbytes, 0.0)

    chunk = 2048  # a prefill chunk at the end of a context of the same length
    ctx = 2 * chunk
    per_seq = ctx // BS
    table = torch.randperm(per_seq, device="cuda", generator=gen).int().view(1, per_seq)
    qv = torch.randn(chunk, H, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    qsl = torch.tensor([0, chunk], dtype=torch.int32, device="cuda")
    seq = torch.tensor([ctx], dtype=torch.int32, device="cuda")
    base = cache(gen, per_seq, torch.bfloat16)
    times, outs = {}, {}
    for dt in (torch.bfloat16, FP8):
        kv = base if dt == torch.bfloat16 else base.to(dt)
        out = torch.empty_like(qv)
        prefill = partial(paged_attention_varlen, qv, kv[0], kv[1], out, qsl, seq, table,
                          D**-0.5, chunk, ctx, **scales[dt])  # fmt: skip
        prefill()
        outs[dt] = out.float()
        times[dt] = do_bench_cudagraph(prefill, return_mode="median")
    err = (outs[FP8] - outs[torch.bfloat16]).abs().max().item()
    record("prefill", f"chunk={chunk} ctx={ctx}", times, {}, err)
    return rows


def accuracy(args) -> dict:
    from common import chat_prompts

    from paged import LLM, SamplingParams

    prompts = chat_prompts(args.acc_prompts)
    params = SamplingParams(temperature=0, max_tokens=args.acc_tokens, logprobs=0)
    runs = {}
    for kv in ("auto", "fp8"):
        llm = LLM(dtype=args.accuracy_dtype, kv_cache_dtype=kv, max_model_len=1024)
        outs = llm.chat(prompts, params, use_tqdm=False)
        runs[kv] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
        del llm
    same = total = identical = 0
    drift: list[float] = []
    for (ref, ref_lp), (got, got_lp) in zip(runs["auto"], runs["fp8"]):
        total += len(ref)
        n = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
        same += n
        identical += ref == got
        drift += [abs(got_lp[i][got[i]].logprob - ref_lp[i][ref[i]].logprob) for i in range(n)]
    res = {
        "prompts": len(prompts), "tokens": total, "dtype": args.accuracy_dtype,
        "matching_prefix_share": same / max(total, 1), "identical_prompts": identical,
        "logprob_drift_mean": sum(drift) / max(len(drift), 1),
        "logprob_drift_max": max(drift, default=0.0),
    }  # fmt: skip
    print(json.dumps(res), flush=True)
    return res


def engine_bench(args, kv_dtype: str, out: Path) -> dict:
    save = out / f"throughput-{kv_dtype}.json"
    cmd = [sys.executable, "-m", "paged.cli.main", "bench", "throughput", "--model", args.model,
           "--load-format", "dummy", "--dtype", "bfloat16", "--kv-cache-dtype", kv_dtype,
           "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
           "--output-len", str(args.output_len), "--max-num-seqs", str(args.max_num_seqs),
           "--no-enable-prefix-caching", *shlex.split(args.engine_args), "--save-json",
           str(save), "--disable-tqdm"]  # fmt: skip
    res: dict = {"kv_cache_dtype": kv_dtype, "command": shlex.join(cmd)}
    print(f"$ {shlex.join(cmd)}", flush=True)
    try:
        p = subprocess.run(cmd, timeout=args.timeout, capture_output=True, text=True, cwd=ROOT)
        res["log_tail"] = (p.stdout + p.stderr)[-1500:]
        if p.returncode:
            res["error"] = res["log_tail"]
            print(res["error"], flush=True)
    except subprocess.TimeoutExpired:
        res["error"] = f"timed out after {args.timeout} s"
    if save.is_file():
        res["result"] = json.loads(save.read_text())
        print(json.dumps(res["result"])[:600], flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="1024,8192,32768")
    ap.add_argument("--tokens", type=int, default=262144, help="batch x context per decode row")
    ap.add_argument(
        "--fp8-tiles",
        default="256/4/3,128/8/3,256/8/2",
        help="fp8 decode launch tiles to time too: block_n/num_warps/num_stages,...",
    )
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--num-prompts", type=int, default=512)
    ap.add_argument("--input-len", type=int, default=2048)
    ap.add_argument("--output-len", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=512)
    ap.add_argument("--engine-args", default="--kv-cache-memory 16GiB",
                    help="extra engine flags, the same for both runs")  # fmt: skip
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--skip-kernels", action="store_true")
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--skip-accuracy", action="store_true")
    ap.add_argument("--accuracy-only", action="store_true", help="any device, e.g. CPU")
    ap.add_argument("--accuracy-dtype", default="bfloat16")
    ap.add_argument("--acc-prompts", type=int, default=64)
    ap.add_argument("--acc-tokens", type=int, default=64)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "bench"))
    from common import write_results

    rows: list[tuple[str, str]] = []
    if args.accuracy_only or not args.skip_accuracy:
        acc = accuracy(args) if args.accuracy_only or torch.cuda.is_available() else None
        if acc is not None:
            rows.append((f"accuracy: default model, {acc['dtype']}, {acc['prompts']} chat prompts",
                         f"{acc['matching_prefix_share']:.1%} of {acc['tokens']} greedy tokens "
                         f"match auto's up to the first difference, {acc['identical_prompts']} "
                         f"prompts identical; logprob drift mean {acc['logprob_drift_mean']:.4f}"
                         f" max {acc['logprob_drift_max']:.3f}"))  # fmt: skip
    if args.accuracy_only:
        write_results("kv-fp8-gpu.md", "fp8 KV cache accuracy", rows, {"accuracy": acc})
        print("\n| run | result |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows))
        return
    if not torch.cuda.is_available():
        print("kv_fp8_gpu: needs a CUDA device; nothing run")
        return
    extra: dict = {"gpu": torch.cuda.get_device_name()}
    if rows:
        extra["accuracy"] = acc
    if not args.skip_kernels:
        tiles = [tuple(int(x) for x in t.split("/")) for t in args.fp8_tiles.split(",") if t]
        contexts = [int(c) for c in args.contexts.split(",")]
        extra["kernels"] = kernel_bench(contexts, args.tokens, tiles)
        for r in extra["kernels"]:
            if r["kernel"] == "decode-fp8-tiles":
                continue
            gbps = f", {r['bf16_GBps']:.0f} / {r['fp8_GBps']:.0f} GB/s" if "fp8_GBps" in r else ""
            rows.append((f"{r['kernel']} {r['shape']}",
                         f"bf16 {r['bf16_us']:.1f} us, fp8 {r['fp8_us']:.1f} us "
                         f"({r['speedup']:.2f}x{gbps})"))  # fmt: skip
    if not args.skip_engine:
        out = Path(tempfile.mkdtemp(prefix="kv-fp8-"))
        extra["engine"] = [engine_bench(args, kv, out) for kv in ("auto", "fp8")]
        for r in extra["engine"]:
            res = r.get("result", {})
            text = (
                r.get("error", "")[-200:]
                or ", ".join(
                    f"{k} {v:,.1f}" if isinstance(v, float) else f"{k} {v}"
                    for k, v in res.items()
                    if not isinstance(v, (dict, list))
                )[:400]
            )
            rows.append((f"throughput --kv-cache-dtype {r['kv_cache_dtype']}",
                         text.replace("|", "/").replace("\n", " ")))  # fmt: skip
    write_results("kv-fp8-gpu.md", f"fp8 KV cache, {args.model}, {extra['gpu']}", rows, extra)
    print("\n| run | result |\n|---|---|")
    for k, v in rows:
        print(f"| {k} | {v} |")


if __name__ == "__main__":
    main()
