"""Where a decode step's device time goes: torch.profiler over a generation with random
weights in a real shape, kernels summed by name per generated token, and the device's idle time
between them.

    python bench/decode_profile.py [--model llama-3.1-8b] [--batch 1] [--tokens 64]
        [--quantization fp8] [--kv-cache-dtype fp8] [--prompt-len 16] [--no-cuda-pdl]

Prints which dense linears' one-row products run the split-K GEMV instead of cuBLAS (the CUDA
plugin's start-up choice), then per step: wall time, device busy and idle (gaps over 20 us: the
host was late), and the kernels by their time per step (calls per step beside). With
programmatic dependent launch (the CUDA plugin's default) a kernel starts while the one before
it ends, so the kernels' own times overlap and sum to more than the step: busy is the union of
their intervals; `--no-cuda-pdl` gives each kernel's time alone. The prompt is
16 tokens, so the one prefill step weighs little against `--tokens` decode steps; `--tokens 1
--prompt-len 512` profiles a prefill step alone (run eagerly: is the host or the device late?).
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
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--no-cuda-pdl", action="store_true", help="plain launches (--cuda-pdl off)")
    ap.add_argument("--cuda-fp8-weight-only-decode", action="store_true",
                    help="one-row fp8 linears weight-only (the platform option of that name)")
    ap.add_argument(
        "--sync-debug",
        action="store_true",
        help="also run a generation under torch.cuda.set_sync_debug_mode('warn') and list the "
        "host lines that synchronized with the device (where the host waits, the device may "
        "idle)",
    )
    args = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile

    path = shape_dir(args.model, Path(tempfile.mkdtemp()) / args.model)
    llm = LLM(path, load_format="dummy", dtype=args.dtype, quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype, enable_prefix_caching=False,
              max_model_len=args.prompt_len + args.tokens + 16,
              max_num_seqs=max(args.batch, 1),
              platform_options={**({"cuda_pdl": False} if args.no_cuda_pdl else {}),
                                **({"cuda_fp8_weight_only_decode": True}
                                   if args.cuda_fp8_weight_only_decode else {})})  # fmt: skip
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 30000) for _ in range(args.prompt_len)]}
               for _ in range(args.batch)]  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up: graphs, kernels
    print_gemv_choices(llm)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t
    dev = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                 if e.device_type.name != "CPU")  # fmt: skip
    if not dev:
        print("no device events: a CPU run")
        return
    steps = args.tokens
    by_name: dict[str, list[float]] = {}
    idle, busy, end = 0.0, 0.0, dev[0][0]
    for start, stop, name in dev:  # sorted by start: busy is the intervals' union
        if start - end > 20:
            idle += start - end
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
        entry = by_name.setdefault(name[:90], [0, 0.0])
        entry[0] += 1
        entry[1] += stop - start
    summed = sum(v[1] for v in by_name.values())
    print(f"{args.model} {args.dtype} quantization={args.quantization} kv={args.kv_cache_dtype} "
          f"batch {args.batch}, {steps} tokens: wall {wall * 1e3 / steps:.3f} ms a step, device "
          f"busy {busy / 1e3 / steps:.3f} ms (kernels' times summed {summed / 1e3 / steps:.3f}), "
          f"idle {idle / 1e3 / steps:.3f} ms ({len(dev) / steps:.0f} device events a "
          "step)")  # fmt: skip
    for name, (calls, us) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[: args.top]:
        print(f"  {us / steps:8.1f} us  {calls / steps:6.1f} calls  {name}")
    if args.sync_debug:
        sync_sites(llm, prompts, params, steps)


def print_gemv_choices(llm: LLM) -> None:
    """The dense linears whose one-row product runs paged's split-K GEMV (the CUDA plugin's
    start-up timing against cuBLAS chose it: paged_cuda/gemv_select.py), by weight shape."""
    chosen: dict[tuple, list] = {}
    for mod in llm.engine.runner.model.modules():
        fwd = mod.__dict__.get("forward")
        if type(fwd).__name__ == "OneRowGemv":
            kind = f"{'fp8 weight-only ' if fwd.scale is not None else ''}split-K GEMV"
            how = f"{kind} {fwd.config}{'' if fwd.fold else ', the op before in its own kernel'}"
            chosen.setdefault(tuple(fwd.weight.shape), []).append(how)
    if not chosen:
        print("one-row linears: cuBLAS for every shape")
    for shape, hows in chosen.items():
        print(f"one-row linears {shape[0]}x{shape[1]} ({len(hows)}): {hows[0]} "
              "(BLOCK_N, BLOCK_K, SPLIT, warps)")  # fmt: skip


def sync_sites(llm: LLM, prompts, params, steps: int) -> None:
    """The paged lines whose torch calls synchronized host and device during a generation,
    by count per step (PyTorch's own detector: it flags copies and calls that wait)."""
    import traceback
    import warnings

    import torch

    sites: dict[str, int] = {}

    def record(message, category, filename, lineno, file=None, line=None) -> None:
        stack = [f for f in traceback.extract_stack() if "/paged/" in f.filename]
        at = f"{stack[-1].filename.split('/paged/')[-1]}:{stack[-1].lineno}" if stack else "?"
        sites[at] = sites.get(at, 0) + 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record  # restored by catch_warnings
        old = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            llm.generate(prompts, params, use_tqdm=False)
        finally:
            torch.cuda.set_sync_debug_mode(old)
    print(f"synchronizing calls per step ({len(sites)} sites):")
    for at, n in sorted(sites.items(), key=lambda kv: -kv[1]):
        print(f"  {n / steps:6.2f}  {at}")


if __name__ == "__main__":
    main()
