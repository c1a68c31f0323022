"""The engine's host time per step: a batch of decodes on a tiny model (hidden 64, one layer,
a 4096-token vocabulary) whose forward costs next to nothing on a CPU, so the wall time per
step is the host's own work (scheduling, packing inputs, resolving, detokenizing).

    python bench/host_overhead.py [--batch 256] [--max-tokens 64] [--repeat 3]
        [--prompt-len 16]

--prompt-len sets how many KV blocks each request lists (the block tables packed per step);
--model gemma3 takes a six-layer Gemma 3 (five sliding-window layers of --window, one global:
six KV-cache groups, model/kv_groups.py) instead of the one-layer Llama.

Prints the best pass's ms per step and output tokens/s, and the engine's parts per step
(structured_gpu.Timeline); appends a line to bench/results/host-overhead.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import random
import tempfile
from pathlib import Path

from common import git_rev, machine
from structured_gpu import Timeline, dummy_dir, run

RESULTS = Path(__file__).resolve().parent / "results" / "host-overhead.md"


def tiny_model(path: Path, vocab: int, max_len: int, kind: str = "llama", window: int = 0) -> str:
    from transformers import Gemma3TextConfig, LlamaConfig

    if kind == "gemma3":
        types = ["sliding_attention"] * 5 + ["full_attention"]
        cfg = Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                               vocab_size=vocab, max_position_embeddings=max_len,
                               sliding_window=window, layer_types=types,
                               architectures=["Gemma3ForCausalLM"])  # fmt: skip
        return dummy_dir(cfg, path)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                      max_position_embeddings=max_len,
                      architectures=["LlamaForCausalLM"])  # fmt: skip
    return dummy_dir(cfg, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--model", choices=("llama", "gemma3"), default="llama")
    ap.add_argument("--window", type=int, default=256, help="gemma3: the sliding window")
    args = ap.parse_args()

    from paged import LLM, SamplingParams

    max_len = max(512, args.prompt_len + args.max_tokens + 16)
    path = tiny_model(Path(tempfile.mkdtemp()) / "tiny", args.vocab, max_len, args.model,
                      args.window)  # fmt: skip
    llm = LLM(path, load_format="dummy", dtype="float32", enable_prefix_caching=False,
              max_model_len=max_len, max_num_seqs=args.batch, async_scheduling=True)  # fmt: skip
    rng = random.Random(0)
    prompts = [[rng.randrange(100, args.vocab) for _ in range(args.prompt_len)]
               for _ in range(args.batch)]  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    run(llm, prompts, params)  # warm-up
    best = None
    for _ in range(args.repeat):
        with Timeline(llm.engine) as tl:
            rate = run(llm, prompts, params)
        steps = tl.totals["EngineCore.step"][0]
        ms = tl.wall * 1e3 / steps
        if best is None or ms < best[0]:
            best = (ms, rate, tl.report())
    ms, rate, report = best
    print(report)
    prompt = f", prompts of {args.prompt_len}" if args.prompt_len != 16 else ""
    if args.model == "gemma3":
        prompt += f", Gemma 3 (6 KV groups, window {args.window})"
    line = (f"| {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} | {git_rev()} | {machine()} | "
            f"batch {args.batch} x {args.max_tokens} tokens{prompt} | "
            f"{ms:.2f} ms a step | {rate:,.0f} tok/s |")  # fmt: skip
    print(line)
    if not RESULTS.exists():
        RESULTS.write_text(
            "# Host time per step (`python bench/host_overhead.py`)\n\n"
            "Command: `python bench/host_overhead.py --batch 256 --max-tokens 64 --repeat 3`;"
            " the best of the passes.\n\n"
            "| date (UTC) | commit | machine | workload | host time | output |\n"
            "|---|---|---|---|---|---|\n"
        )
    with RESULTS.open("a") as f:
        f.write(line + "\n")


if __name__ == "__main__":
    main()
