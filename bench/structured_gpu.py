"""Structured outputs on a GPU: throughput with every request JSON-schema constrained against the
same run unconstrained, at a large batch, on a named shape with dummy weights.

    python bench/structured_gpu.py [--model llama-3.1-8b] [--batch 256] [--input-len 128]
        [--max-tokens 64] [--repeat 2]

Random weights give meaningless text, so only speed means anything here. The shape gets a
tokenizer whose vocabulary is every printable ASCII string of one and two characters, then
three-character ones up to the shape's vocabulary size: JSON can be spelled in it (a word-level
"t<id>" vocabulary could not), so xgrammar builds real masks over the full vocabulary. Prompts
are random token ids. The schema is bench/structured.py's (an unbounded array of records), but
random weights may still close the JSON early, and a finished grammar ends the request whatever
ignore_eos says. So the unconstrained requests are given each constrained request's output
length (measured in the warm-up pass): both kinds generate the same tokens per request, in the
same steps at the same batch sizes, and differ only by the masks. Passes alternate (ABBA) in
one engine; the figure is output tokens/s per kind (best pass) and their ratio.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import os
import random
import string
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from structured import SCHEMA  # noqa: E402  (bench/ is the script's directory)

from paged import LLM, SamplingParams  # noqa: E402
from paged.sampling.params import StructuredOutputsParams  # noqa: E402


def printable_vocab(size: int) -> list[str]:
    """`size` distinct strings: printable ASCII of length 1, 2, then 3."""
    chars = [c for c in string.printable if c not in "\t\n\r\x0b\x0c"]
    out: list[str] = []
    for n in (1, 2, 3):
        for combo in itertools.product(chars, repeat=n):
            out.append("".join(combo))
            if len(out) == size:
                return out
    raise ValueError(f"vocabulary of {size} is too large")


def shape_dir(model: str, path: Path) -> str:
    """The named shape's model directory for --load-format dummy (dummy_dir)."""
    from paged.model.shapes import shape_config

    return dummy_dir(shape_config(model), path)


def dummy_dir(cfg, path: Path) -> str:
    """A transformers config's config.json, an empty weights file (dummy weights are drawn)
    and a tokenizer over printable_vocab (its strings are its tokens: no pre-tokenizer
    merges)."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(path)
    save_file({}, str(path / "model.safetensors"))
    vocab = {s: i for i, s in enumerate(printable_vocab(cfg.vocab_size))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=" "))
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(path)
    return str(path)


class Timeline:
    """Wall time spent in the engine's parts, per step (methods wrapped on the instances):
    which host work lies on the step loop's path, the mask thread's fill beside it."""

    def __init__(self, engine, ranges: bool = False) -> None:
        from paged.engine import core
        from paged.sampling import structured

        self.engine, self.totals, self.patched, self.ranges = engine, {}, [], ranges
        runner = engine.runner
        self.targets = [
            (engine, "step"), (engine.scheduler, "schedule"), (engine.executor, "launch"),
            (engine, "_fill_beside"), (engine, "_resolve"), (engine.structured, "accept_early"),
            (engine.structured, "begin_fill"), (runner, "_sample"),
            (core.DeferredMask, "__call__"), (structured.MaskFill, "grammar"),
            (structured.MaskFill, "finish"),
        ]  # fmt: skip

    @staticmethod
    def key(obj, name: str) -> str:
        return f"{getattr(obj, '__name__', type(obj).__name__)}.{name}"

    def __enter__(self) -> Timeline:
        for obj, name in self.targets:
            fn = getattr(obj, name)
            key = self.key(obj, name)

            def timed(*a, _fn=fn, _key=key, **k):
                t = time.perf_counter()
                try:
                    if self.ranges:  # named ranges in a torch.profiler trace
                        with torch.profiler.record_function(_key):
                            return _fn(*a, **k)
                    return _fn(*a, **k)
                finally:
                    n, total = self.totals.get(_key, (0, 0.0))
                    self.totals[_key] = (n + 1, total + time.perf_counter() - t)

            setattr(obj, name, timed)
            self.patched.append((obj, name, fn))
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.wall = time.perf_counter() - self.t0
        for obj, name, fn in reversed(self.patched):
            if isinstance(obj, type):
                setattr(obj, name, fn)
            else:
                delattr(obj, name)

    def report(self) -> str:
        steps = self.totals.get("EngineCore.step", (1, 0.0))[0]
        lines = [f"{steps} steps, {self.wall * 1e3 / steps:.2f} ms a step (wall)"]
        for key, (n, total) in sorted(self.totals.items(), key=lambda kv: -kv[1][1]):
            lines.append(f"  {key:32s} {n:6d} calls {total * 1e3 / steps:8.3f} ms a step")
        return "\n".join(lines)


def device_profile(llm: LLM, prompts: list[list[int]], kinds) -> None:
    """Per pass: wall time, the device's busy time (kernels and copies), and the kernels whose
    total time differs most between the kinds."""
    from torch.profiler import ProfilerActivity, profile

    per_kind = {}
    for kind, params in kinds:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t = time.perf_counter()
            run(llm, prompts, params)
            wall = time.perf_counter() - t
        totals: dict[str, float] = {}
        for e in prof.events():  # the device's own events: kernels, copies
            if e.device_type.name != "CPU":
                totals[e.name[:70]] = totals.get(e.name[:70], 0.0) + e.time_range.elapsed_us()
        busy = sum(totals.values()) / 1e6
        per_kind[kind] = totals
        print(f"=== device profile, {kind}: wall {wall * 1e3:.0f} ms, device busy "
              f"{busy * 1e3:.0f} ms ({busy / wall:.0%})")  # fmt: skip
    (a, ta), (b, tb) = per_kind.items()
    diff = sorted(set(ta) | set(tb), key=lambda k: -abs(tb.get(k, 0) - ta.get(k, 0)))
    for name in diff[:15]:
        ms_a, ms_b = ta.get(name, 0) / 1e3, tb.get(name, 0) / 1e3
        print(f"  {name:70s} {a} {ms_a:8.1f} ms  {b} {ms_b:8.1f} ms")


def device_waits(dev: list, host: list) -> tuple[float, dict, dict]:
    """Idle microseconds between device events (start, end, name) longer than launch latency,
    by the event that ended each wait and by the host ranges (start, end, name, thread) that
    overlapped it; the stepping thread's time outside EngineCore.step is the caller's."""
    main = next(th for *_, name, th in host if name == "EngineCore.step")
    steps = [(a, b) for a, b, name, th in host if name == "EngineCore.step"]
    by_next: dict[str, float] = {}
    by_host: dict[str, float] = {}
    idle, end = 0.0, dev[0][1]
    for start, stop, name in dev:
        gap = start - end
        if gap > 20:  # microseconds; shorter ones are launch latency
            idle += gap
            by_next[name[:60]] = by_next.get(name[:60], 0.0) + gap
            inside = sum(max(0.0, min(b, start) - max(a, end)) for a, b in steps)
            by_host["(caller, outside EngineCore.step)"] = (
                by_host.get("(caller, outside EngineCore.step)", 0.0) + gap - inside
            )
            for a, b, hname, th in host:
                over = min(b, start) - max(a, end)
                if over > 0:
                    key = f"{hname} ({'stepping' if th == main else 'another'} thread)"
                    by_host[key] = by_host.get(key, 0.0) + over
        end = max(end, stop)
    return idle, by_next, by_host


def device_gaps(llm: LLM, prompts: list[list[int]], kinds) -> None:
    """Per pass: the time the device sat idle between kernels and copies, split by the kernel
    that ended the wait and by the engine's parts the host was in meanwhile (the Timeline's
    methods as profiler ranges, on the stepping thread)."""
    from torch.profiler import ProfilerActivity, profile

    for kind, params in kinds:
        with (
            Timeline(llm.engine, ranges=True) as tl,
            profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof,
        ):
            t = time.perf_counter()
            run(llm, prompts, params)
            wall = time.perf_counter() - t
        events = prof.events()
        dev = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                     if e.device_type.name != "CPU")  # fmt: skip
        if not dev:
            print(f"=== device gaps, {kind}: no device events (a CPU run)")
            continue
        names = {Timeline.key(obj, name) for obj, name in tl.targets}
        host = [(e.time_range.start, e.time_range.end, e.name, e.thread) for e in events
                if e.device_type.name == "CPU" and e.name in names]  # fmt: skip
        idle, by_next, by_host = device_waits(dev, host)
        span = (dev[-1][1] - dev[0][0]) / 1e3
        print(f"=== device gaps, {kind}: wall {wall * 1e3:.0f} ms, device span {span:.0f} ms, "
              f"idle (gaps over 20 us) {idle / 1e3:.1f} ms")  # fmt: skip
        print("  by the kernel that ended the wait:")
        for name, us in sorted(by_next.items(), key=lambda kv: -kv[1])[:8]:
            print(f"    {name:60s} {us / 1e3:8.1f} ms")
        print("  host ranges overlapping the waits (nested ranges each count):")
        for name, us in sorted(by_host.items(), key=lambda kv: -kv[1])[:14]:
            print(f"    {name:60s} {us / 1e3:8.1f} ms")


def generate(llm: LLM, prompts: list[list[int]], params) -> tuple[float, list[int]]:
    """(output tokens/s, each request's output length)."""
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    return sum(lengths) / (time.perf_counter() - t), lengths


def run(llm: LLM, prompts: list[list[int]], params) -> float:
    return generate(llm, prompts, params)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument(
        "--no-async-scheduling",
        action="store_true",
        help="both kinds without overlapped steps (masked requests never overlap)",
    )
    ap.add_argument(
        "--timeline",
        action="store_true",
        help="print the wall time per step of the engine's parts for a pass of each kind",
    )
    ap.add_argument(
        "--device-profile",
        action="store_true",
        help="torch.profiler over a pass of each kind: device busy time against wall time and "
        "the kernels that differ",
    )
    ap.add_argument(
        "--device-gaps",
        action="store_true",
        help="torch.profiler over a pass of each kind: the device's idle time between kernels, "
        "by the kernel that ended it and by what the host was doing meanwhile",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="print a cProfile of one pass of each kind (host time by function)",
    )
    args = ap.parse_args()
    path = shape_dir(args.model, Path(tempfile.mkdtemp()) / args.model)
    llm = LLM(path, load_format="dummy", dtype=args.dtype, enable_prefix_caching=False,
              max_model_len=args.input_len + args.max_tokens + 64,
              max_num_seqs=args.batch,
              async_scheduling=False if args.no_async_scheduling else None)  # fmt: skip
    rng = random.Random(0)
    vocab = llm.engine.vocab_size
    prompts = [[rng.randrange(100, vocab) for _ in range(args.input_len)]
               for _ in range(args.batch)]  # fmt: skip
    so = StructuredOutputsParams(json=SCHEMA)
    # no ignore_eos beside a grammar (refused): the grammar alone decides where it ends
    constrained = SamplingParams(temperature=0, max_tokens=args.max_tokens, structured_outputs=so)
    t = time.perf_counter()
    run(llm, prompts[:1], SamplingParams(max_tokens=2, structured_outputs=so))
    first = time.perf_counter() - t  # grammar compile (new schema) included
    _, lengths = generate(llm, prompts, constrained)  # warm-up, and each request's length
    plain = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    _, plain_lengths = generate(llm, prompts, plain)  # warm-up: the same batch shapes
    assert plain_lengths == lengths, "the unconstrained pass must generate the same tokens"
    print(
        f"output tokens per pass: {sum(lengths)} ({sum(lengths) / len(lengths):.1f} per "
        f"request of at most {args.max_tokens})",
        flush=True,
    )
    best = {"plain": 0.0, "json_schema": 0.0}
    for i in range(args.repeat):
        for kind in ("plain", "json_schema") if i % 2 == 0 else ("json_schema", "plain"):
            rate = run(llm, prompts, plain if kind == "plain" else constrained)
            best[kind] = max(best[kind], rate)
            print(f"pass {i} {kind}: {rate:,.0f} output tok/s", flush=True)
    if args.timeline:
        for kind, params in (("plain", plain), ("json_schema", constrained)):
            with Timeline(llm.engine) as tl:
                rate = run(llm, prompts, params)
            print(f"=== timeline, one {kind} pass ({rate:,.0f} tok/s)")
            print(tl.report())
    if args.device_profile:
        device_profile(llm, prompts, (("plain", plain), ("json_schema", constrained)))
    if args.device_gaps:
        device_gaps(llm, prompts, (("plain", plain), ("json_schema", constrained)))
    if args.profile:
        import cProfile
        import pstats

        for kind, params in (("plain", plain), ("json_schema", constrained)):
            prof = cProfile.Profile()
            rate = prof.runcall(run, llm, prompts, params)
            print(f"=== cProfile, one {kind} pass ({rate:,.0f} tok/s under the profiler)")
            pstats.Stats(prof).sort_stats("tottime").print_stats(22)
    ratio = best["json_schema"] / best["plain"]
    print(
        f"\n{dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC {args.model} {args.dtype} batch "
        f"{args.batch}, {args.input_len} in / {args.max_tokens} out: plain "
        f"{best['plain']:,.0f} tok/s, json_schema {best['json_schema']:,.0f} tok/s, "
        f"constrained/plain {ratio:.3f} ({(1 - ratio) * 100:.1f} % slower); first request "
        f"with a new schema (compile included) {first * 1e3:.0f} ms"
    )


if __name__ == "__main__":
    main()
