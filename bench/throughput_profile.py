"""Where the device time of an offline throughput run goes: torch.profiler over a whole
`LLM.generate` of --num-prompts random prompts (random weights in a real shape), kernels
summed by name, busy time against wall time.

    python bench/throughput_profile.py [--model llama-3.1-8b] [--num-prompts 1000]
        [--input-len 256] [--output-len 256] [--quantization fp8] [--kv-cache-dtype fp8]
        [--max-num-seqs N]

Sampling as `paged bench throughput` (temperature 1, ignore_eos). A first unprofiled pass
warms up and prints the plain tok/s. Needs a GPU (a CPU run has no device events).
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from structured_gpu import shape_dir  # noqa: E402

from paged import LLM, SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile

    path = shape_dir(args.model, Path(tempfile.mkdtemp()) / args.model)
    llm = LLM(path, load_format="dummy", dtype=args.dtype, quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype, enable_prefix_caching=False,
              max_num_seqs=args.max_num_seqs)  # fmt: skip
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 30000) for _ in range(args.input_len)]}
               for _ in range(args.num_prompts)]  # fmt: skip
    params = SamplingParams(temperature=1.0, max_tokens=args.output_len, ignore_eos=True)
    tokens = args.num_prompts * (args.input_len + args.output_len)
    t = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)  # warm-up, and the plain figure
    wall = time.perf_counter() - t
    print(f"unprofiled: {wall:.2f} s, {tokens / wall:,.0f} total tok/s")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t
    total: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type.name != "CPU":
            entry = total.setdefault(e.name[:100], [0, 0.0])
            entry[0] += 1
            entry[1] += e.time_range.end - e.time_range.start
    if not total:
        print("no device events: a CPU run")
        return
    busy = sum(v[1] for v in total.values())
    print(f"profiled: wall {wall:.2f} s, device busy {busy / 1e6:.2f} s")
    for name, (calls, us) in sorted(total.items(), key=lambda kv: -kv[1][1])[: args.top]:
        print(f"{us / 1e6:8.3f} s {100 * us / busy:5.1f} % {calls:8d}  {name}")


if __name__ == "__main__":
    main()
