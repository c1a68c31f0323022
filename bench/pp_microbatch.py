"""Pipeline parallelism on CPU: micro-batches against stages one after another, same run.

    python bench/pp_microbatch.py [--dtype float32] [--prompts 32] [--input-len 512]
        [--output-len 4] [--repeat 2] [--note TEXT]

Builds `LLM(None, ...)` (the default model, prefix caching off) three ways: one rank with
one thread (the work of one stage's process), and `pipeline_parallel_size=2` (two processes
on the host's cores, one thread each) with `pipeline_micro_batches=1` (a step's batch goes
through stage 0, then stage 1) and with the default (two micro-batches per stage: stage 0
computes group k+1 while stage 1 computes group k). Each runs --prompts greedy requests of
--input-len random tokens and --output-len tokens (ignore_eos) after a warm-up, timed end to
end; the figure is tokens/s (prompt and output), best of --repeat passes (alternating). The
default workload is prefill-heavy: micro-batches split only steps of enough tokens to be
compute-bound (worker/pipeline.py MIN_GROUP_TOKENS), so a decode step runs stages in turn.
Outputs of the three are compared token for token. Results: bench/results/pp-cpu.md (a
section appended).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {
    "1 rank": dict(),
    "PP=2, stages in turn": dict(pipeline_parallel_size=2, pipeline_micro_batches=1),
    "PP=2, micro-batches": dict(pipeline_parallel_size=2),
}


def run_variant(kw: dict, args, prompts: list[list[int]]) -> tuple[float, list[list[int]]]:
    import torch

    from paged.engine.llm import LLM
    from paged.sampling.params import SamplingParams

    torch.set_num_threads(1)  # one core per stage process; the one-rank engine gets one too
    llm = LLM(None, dtype=args.dtype, enable_prefix_caching=False,
              max_model_len=args.input_len + args.output_len + 16,
              max_num_seqs=max(len(prompts), 8), **kw)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    warm = [[t + 1 for t in p] for p in prompts[:4]]
    llm.generate([{"prompt_token_ids": p} for p in warm], params, use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    dt_s = time.perf_counter() - t0
    tokens = [o.outputs[0].token_ids for o in outs]
    llm.engine.shutdown()
    return len(prompts) * (args.input_len + args.output_len) / dt_s, tokens


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--note", default="")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "pp-cpu.md"))
    args = ap.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.input_len)]
               for _ in range(args.prompts)]  # fmt: skip
    best: dict[str, float] = {}
    tokens: dict[str, list] = {}
    for _ in range(args.repeat):
        for name, kw in VARIANTS.items():
            rate, toks = run_variant(kw, args, prompts)
            best[name] = max(best.get(name, 0.0), rate)
            tokens[name] = toks
            print(f"{name}: {rate:.1f} tok/s", flush=True)
    ref = tokens["1 rank"]
    same = {n: sum(a == b for a, b in zip(t, ref)) for n, t in tokens.items()}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()  # fmt: skip
    base = best["PP=2, stages in turn"]
    lines = [
        f"\n## {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, {platform.machine()}, "
        f"{os.cpu_count()} cores, commit {commit}\n",
        f"`python bench/pp_microbatch.py {shlex.join(sys.argv[1:])}`: default model, "
        f"{args.dtype}, {args.prompts} prompts x {args.input_len} in / {args.output_len} out, "
        f"greedy, best of {args.repeat}. {args.note}\n",
        "| variant | tok/s (prompt + output) | vs PP=2 stages in turn | same as 1 rank |",
        "|---|---|---|---|",
    ]
    for name in VARIANTS:
        lines.append(f"| {name} | {best[name]:.1f} | {best[name] / base:.2f}x | "
                     f"{same[name]}/{len(ref)} |")  # fmt: skip
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out)
    if not out.exists():
        text = "# Pipeline parallelism on CPU (bench/pp_microbatch.py)\n" + text
    with out.open("a") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
