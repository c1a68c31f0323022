"""Per-step overhead of tensor parallelism on CPU: TP=2 against TP=1, same run, default model.

    python bench/tp_overhead.py [--dtype float32] [--batch-sizes 1,16] [--output-len 64]
        [--input-len 128] [--prefill-tokens 512] [--iters 3] [--repeat 1] [--note TEXT]

For tp in (1, 2) it builds `LLM(None, tensor_parallel_size=tp, ...)` (the default model,
prefix caching off so every prefill is computed), warms up, then steps `llm.engine` directly:

- decode: for each batch size b, b random prompts of --input-len tokens, --output-len tokens
  each (greedy, ignore_eos); a step counts as decode once every sequence has its first token.
- prefill: --prefill-tokens prompt tokens in one step (prompts of --input-len), one output
  token each.

Figures: mean ms per step for each workload and TP size, the TP=2 / TP=1 ratio, and the time
the driver (rank 0, this process) spends inside collectives per step. The collectives are
timed by wrapping `tp_all_reduce`, `tp_gather_first` and `broadcast_host` here only (the
worker processes run unchanged) wherever paged's modules imported them: each call's wall time
(perf_counter) and count accumulate per step. On gloo a collective returns once the data is
exchanged, so its time includes waiting for the slower rank, not just moving bytes.

With --repeat N the TP=1 and TP=2 engines are built N times, alternately; each figure is the
best pass (a shared host's speed drifts during a run). Results: bench/results/tp-cpu.md (a
section appended) and bench/results/tp-cpu-latest.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from common import RESULTS  # noqa: E402

COLLECTIVES = ("tp_all_reduce", "tp_gather_first", "broadcast_host")
TP_SIZES = (1, 2)


# ---- collective timing (driver process only) -------------------------------------------
class CollectiveTimer:
    """Wall time and calls of the driver's collectives since the last reset()."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(COLLECTIVES, 0.0)
        self.calls = dict.fromkeys(COLLECTIVES, 0)
        self.patched: list[str] = []

    def reset(self) -> None:
        for name in COLLECTIVES:
            self.seconds[name], self.calls[name] = 0.0, 0

    def snapshot(self) -> dict[str, tuple[float, int]]:
        return {n: (self.seconds[n], self.calls[n]) for n in COLLECTIVES}

    def _timed(self, name: str, fn):
        seconds, calls, clock = self.seconds, self.calls, time.perf_counter

        def timed(*args, **kwargs):
            t = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[name] += clock() - t
                calls[name] += 1

        timed.__wrapped__ = fn
        return timed

    def install(self) -> None:
        """Replace each collective in paged.distributed and in every paged module that
        imported it by name (`from paged.distributed import tp_all_reduce`)."""
        import paged.distributed as d
        import paged.engine.llm  # noqa: F401  (the engine, executors and workers)
        import paged.model.llama  # noqa: F401
        import paged.model.parallel  # noqa: F401
        import paged.worker.model_runner  # noqa: F401

        for name in COLLECTIVES:
            orig = getattr(d, name)
            timed = self._timed(name, orig)
            for mod_name, mod in list(sys.modules.items()):
                if mod_name.split(".")[0] == "paged" and getattr(mod, name, None) is orig:
                    setattr(mod, name, timed)
                    self.patched.append(f"{mod_name}.{name}")
        for need in (
            "paged.model.llama.tp_all_reduce",
            "paged.model.llama.tp_gather_first",
            "paged.model.parallel.tp_all_reduce",
            "paged.worker.model_runner.broadcast_host",
        ):
            assert need in self.patched, f"{need} was not wrapped ({self.patched})"


# ---- the bare collective, for scale ---------------------------------------------------------
def _bare_rank(rank: int, port: int, shapes: list, dtype: str, iters: int, q) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)  # as each TP=2 rank on a 2-core host
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    out = []
    for shape in shapes:
        x = torch.randn(*shape).to(getattr(torch, dtype))
        for _ in range(20):
            dist.all_reduce(x)
        t = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        out.append((time.perf_counter() - t) * 1000 / iters)
    dist.destroy_process_group()
    if rank == 0:
        q.put(out)


def bare_all_reduce_ms(shapes: list[tuple[int, int]], dtype: str, iters: int = 300) -> list:
    """ms per gloo all_reduce of each shape between two otherwise idle processes: the
    transfer and wake-up cost alone, with no rank waiting for the other's compute."""
    import multiprocessing
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    procs = [
        ctx.Process(target=_bare_rank, args=(r, port, shapes, dtype, iters, q)) for r in range(2)
    ]
    for p in procs:
        p.start()
    out = q.get(timeout=300)
    for p in procs:
        p.join(30)
    return out


# ---- workloads ---------------------------------------------------------------------------
def random_prompts(n: int, length: int, vocab: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def run_batch(engine, prompts: list[list[int]], params, timer: CollectiveTimer, tag: str):
    """Step the engine until the batch is done. Returns ([(kind, seconds, collectives)] per
    step, {request: tokens}); kind is "decode" once every sequence had its first token
    before the step, else "prefill"."""
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, params)
    started: set[str] = set()
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    steps = []
    while engine.has_unfinished():
        kind = "decode" if len(started) == len(ids) else "prefill"
        timer.reset()
        t = time.perf_counter()
        outs = engine.step()
        dt_s = time.perf_counter() - t
        steps.append((kind, dt_s, timer.snapshot()))
        for o in outs:
            if o.error:
                raise RuntimeError(f"request {o.request_id} failed: {o.error}")
            if o.new_token_ids:
                started.add(o.request_id)
                tokens[o.request_id] += o.new_token_ids
    return steps, tokens


def summarize(steps: list) -> dict:
    """Figures over steps: ms per step (mean, median), collectives ms (mean, median) and
    calls per step, in all and by collective (means)."""
    n = len(steps)
    ms = sorted(s[1] * 1000 for s in steps)
    coll = sorted(sum(sec for sec, _ in s[2].values()) * 1000 for s in steps)
    out = {
        "steps": n,
        "mean_ms": sum(ms) / n,
        "p50_ms": ms[n // 2],
        "collective_ms": sum(coll) / n,
        "collective_p50_ms": coll[n // 2],
        "collective_calls": sum(c for s in steps for _, c in s[2].values()) / n,
        "by_collective": {
            name: {
                "ms": sum(s[2][name][0] for s in steps) * 1000 / n,
                "calls": sum(s[2][name][1] for s in steps) / n,
            }
            for name in COLLECTIVES
        },
    }
    return out


def measure(tp: int, args, timer: CollectiveTimer, threads0: int) -> dict:
    from paged import LLM, SamplingParams

    torch.set_num_threads(threads0)  # a TP>1 driver before us lowered this process's threads
    t0 = time.perf_counter()
    llm = LLM(
        None,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        kv_cache_memory=args.kv_cache_memory,
        tensor_parallel_size=tp,
        enable_prefix_caching=False,  # every timed prefill is computed
        cpu_gguf_blocks=args.gguf_blocks,  # dense linears at every TP size unless asked
    )
    build_s = time.perf_counter() - t0
    engine = llm.engine
    rng = random.Random(args.seed)
    vocab = engine.vocab_size
    decode = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    prefill = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    n_prefill = -(-args.prefill_tokens // args.input_len)
    res: dict = {
        "tp": tp,
        "build_s": round(build_s, 1),
        "driver_threads": torch.get_num_threads(),
        "num_blocks": engine.num_blocks,
        "hidden_size": engine.hf_config.hidden_size,
        "workloads": {},
    }
    try:
        # Warm-up: every shape once, untimed.
        for b in args.batch_sizes:
            run_batch(
                engine, random_prompts(b, args.input_len, vocab, rng), decode, timer, f"warm-{b}"
            )
        run_batch(
            engine,
            random_prompts(n_prefill, args.input_len, vocab, rng),
            prefill,
            timer,
            "warm-prefill",
        )
        same_prompts = random.Random(args.seed + 1)  # the same decode prompts at every TP size
        for b in args.batch_sizes:
            prompts = random_prompts(b, args.input_len, vocab, same_prompts)
            steps, first_tokens = [], None
            for i in range(args.iters):
                s, toks = run_batch(engine, prompts, decode, timer, f"decode-{b}-{i}")
                steps += [x for x in s if x[0] == "decode"]
                first_tokens = first_tokens or [toks[k] for k in sorted(toks)]
            fig = summarize(steps) | {"rows": b, "tokens": first_tokens}
            res["workloads"][f"decode, batch {b}"] = fig
        steps = []
        for i in range(args.iters):
            prompts = random_prompts(n_prefill, args.input_len, vocab, rng)  # fresh each time
            s, _ = run_batch(engine, prompts, prefill, timer, f"prefill-{i}")
            steps += [x for x in s if x[0] == "prefill"]
        name = f"prefill, {n_prefill} x {args.input_len} tokens"
        res["workloads"][name] = summarize(steps) | {"rows": n_prefill * args.input_len}
        res["preemptions"] = engine.scheduler.num_preemptions
    finally:
        engine.shutdown()
    return res


# ---- reporting ---------------------------------------------------------------------------
def machine() -> str:
    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu
            )
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{platform.machine()}, {cores} cores (nproc), {cpu}"


def commit() -> str:
    root = RESULTS.parent.parent

    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], capture_output=True, text=True, cwd=root).stdout
        except OSError:
            return ""

    rev = git("rev-parse", "--short", "HEAD").strip() or "?"
    return rev + (" + uncommitted changes" if git("status", "--porcelain").strip() else "")


def best(passes: list[dict]) -> dict:
    """Per TP size and workload, the pass with the lowest mean step time."""
    out: dict = {}
    for p in passes:
        slot = out.setdefault(p["tp"], {**p, "workloads": {}})
        for w, fig in p["workloads"].items():
            if w not in slot["workloads"] or fig["mean_ms"] < slot["workloads"][w]["mean_ms"]:
                slot["workloads"][w] = fig
    return out


def table(by_tp: dict, bare: dict[str, float]) -> tuple[list[str], dict]:
    """Markdown lines and the figures. bare: workload -> ms of one bare all_reduce of the
    step's activation shape (bare_all_reduce_ms)."""
    one, two = by_tp[1]["workloads"], by_tp[2]["workloads"]
    head = [
        "| workload | TP=1 ms/step, mean (p50) | TP=2 ms/step, mean (p50) | TP=2 / TP=1, mean "
        "(p50) | TP=2 driver in collectives, ms/step mean (p50), share of mean step | "
        "collective calls/step | bare gloo all_reduce, ms/step |",
        "|---|---|---|---|---|---|---|",
    ]
    figures, same_lines = {}, []
    for w in one:
        a, b = one[w], two[w]
        ratio = b["mean_ms"] / a["mean_ms"]
        ratio50 = b["p50_ms"] / a["p50_ms"]
        share = b["collective_ms"] / b["mean_ms"]
        bare_step = bare[w] * b["by_collective"]["tp_all_reduce"]["calls"]
        head.append(
            f"| {w} | {a['mean_ms']:.1f} ({a['p50_ms']:.1f}) | {b['mean_ms']:.1f} "
            f"({b['p50_ms']:.1f}) | {ratio:.2f}x ({ratio50:.2f}x) | {b['collective_ms']:.1f} "
            f"({b['collective_p50_ms']:.1f}), {share:.0%} | {b['collective_calls']:.0f} | "
            f"{bare_step:.1f} |"
        )
        figures[w] = {
            "tp1": {k: v for k, v in a.items() if k != "tokens"},
            "tp2": {k: v for k, v in b.items() if k != "tokens"},
            "ratio_tp2_tp1": round(ratio, 3),
            "ratio_tp2_tp1_p50": round(ratio50, 3),
            "tp2_collective_share": round(share, 3),
            "bare_all_reduce_ms": round(bare[w], 4),
            "bare_all_reduce_ms_per_step": round(bare_step, 2),
        }
        if "tokens" in a:
            same = sum(x == y for x, y in zip(a["tokens"], b["tokens"]))
            figures[w]["greedy_sequences_identical"] = f"{same}/{len(a['tokens'])}"
            same_lines.append(f"{w}: {same}/{len(a['tokens'])}")
    head += [
        "",
        "TP=2, driver's time per step in each collective (ms, calls):",
        "",
        "| workload | " + " | ".join(COLLECTIVES) + " |",
        "|---|" + "---|" * len(COLLECTIVES),
    ]
    for w in two:
        cells = [
            f"{two[w]['by_collective'][n]['ms']:.2f} ms, {two[w]['by_collective'][n]['calls']:.0f}"
            for n in COLLECTIVES
        ]
        head.append(f"| {w} | " + " | ".join(cells) + " |")
    head += [
        "",
        "Calls per step at TP=1 (no-ops there): "
        + ", ".join(f"{w}: {f['collective_calls']:.0f}" for w, f in one.items())
        + ". Greedy sequences identical at TP=2 and TP=1 (first timed run): "
        + "; ".join(same_lines)
        + ".",
    ]
    return head, figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--batch-sizes", default="1,16", help="decode batch sizes, comma-separated")
    ap.add_argument("--input-len", type=int, default=128, help="prompt tokens of each request")
    ap.add_argument("--output-len", type=int, default=64, help="tokens generated per request")
    ap.add_argument("--prefill-tokens", type=int, default=512, help="tokens of the prefill step")
    ap.add_argument("--iters", type=int, default=3, help="timed runs of each workload")
    ap.add_argument("--repeat", type=int, default=1, help="passes, TP=1 and TP=2 alternately")
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument(
        "--kv-cache-memory",
        default="256MiB",
        help="per rank; enough for the largest batch without preemption",
    )
    ap.add_argument(
        "--gguf-blocks",
        action="store_true",
        help="bfloat16: let TP=1 use the GGUF block linears (TP>1 cannot: the "
        "ratio then compares different kernels)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--note", default="", help="a sentence added to the results section")
    ap.add_argument("--no-save", action="store_true", help="print only")
    args = ap.parse_args()
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    if max(args.batch_sizes) * args.input_len > 2048 or args.prefill_tokens > 2048:
        ap.error("one prefill step holds at most 2048 tokens (max_num_batched_tokens)")
    if args.input_len + args.output_len > args.max_model_len:
        ap.error("--input-len + --output-len exceeds --max-model-len")

    timer = CollectiveTimer()
    timer.install()
    threads0 = torch.get_num_threads()
    load0 = os.getloadavg()[0]
    passes = []
    for rep in range(args.repeat):
        for tp in TP_SIZES:
            print(f"pass {rep + 1}/{args.repeat}: TP={tp} ...", flush=True)
            r = measure(tp, args, timer, threads0)
            for w, f in r["workloads"].items():
                print(
                    f"  {w}: {f['mean_ms']:.1f} ms/step, collectives {f['collective_ms']:.2f}"
                    f" ms in {f['collective_calls']:.0f} calls",
                    flush=True,
                )
            passes.append(r)
    by_tp = best(passes)
    hidden = by_tp[2]["hidden_size"]
    names = list(by_tp[2]["workloads"])
    shapes = [(by_tp[2]["workloads"][w]["rows"], hidden) for w in names]
    print("bare gloo all_reduce between two processes ...", flush=True)
    bare = dict(zip(names, bare_all_reduce_ms(shapes, args.dtype)))
    lines, figures = table(by_tp, bare)
    load1 = os.getloadavg()[0]
    print("\n" + "\n".join(lines))

    from paged.model.loader import default_model_path

    model = Path(default_model_path()).name
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    argv, skip = [], False  # the note's text is in the section, not in the command
    for a in sys.argv[1:]:
        if not skip and not a.startswith("--note"):
            argv.append(a)
        skip = a == "--note"
    if args.note:
        argv += ["--note", "(the last paragraph)"]
    cmd = shlex.join(["bench/tp_overhead.py", *argv])
    threads = {tp: by_tp[tp]["driver_threads"] for tp in TP_SIZES}
    gguf = ""
    if args.dtype != "float32":
        gguf = ", GGUF block linears at TP=1" if args.gguf_blocks else ", dense linears"
    title = (
        f"TP=2 vs TP=1 per-step overhead on CPU, {model} as {args.dtype}{gguf}, prompts of "
        f"{args.input_len} tokens, {args.output_len} output tokens, greedy ({now})"
    )
    preempt = {tp: by_tp[tp].get("preemptions", 0) for tp in TP_SIZES}
    section = [
        f"\n## {title}\n",
        f"- machine: {machine()}",
        f"- commit: {commit()}",
        f"- command: `python {cmd}`",
        f"- host load average (1 min) at start / end: {load0:.2f} / {load1:.2f}",
        f"- torch threads: TP=1 {threads[1]}; TP=2 {threads[2]} per rank (the ranks split the "
        f"host's cores). KV cache {args.kv_cache_memory} per rank, prefix caching off, "
        f"preemptions {preempt[1]}/{preempt[2]}; {args.iters} timed runs per workload"
        + (f", best of {args.repeat} passes" if args.repeat > 1 else ""),
        "- collectives: wall time inside `tp_all_reduce` / `tp_gather_first` / `broadcast_host` "
        "on the driver (rank 0), including the wait for the other rank; bare gloo all_reduce: "
        "the same activation shape all-reduced in a loop between two idle processes (1 thread "
        "each), times the step's all_reduce calls: the rest is waiting for the other rank.",
        "",
        *lines,
    ]
    if args.note:
        section += ["", args.note]
    if args.no_save:
        return
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / "tp-cpu.md", "a") as f:
        f.write("\n".join(section) + "\n")
    out = {
        "date": now,
        "machine": machine(),
        "commit": commit(),
        "command": cmd,
        "settings": {k: v for k, v in vars(args).items() if k not in ("note", "no_save")},
        "model": model,
        "torch_threads": threads,
        "load_average_start_end": [load0, load1],
        "bare_all_reduce_ms": bare,
        "figures": figures,
        "passes": [
            {
                **p,
                "workloads": {
                    w: {k: v for k, v in f.items() if k != "tokens"}
                    for w, f in p["workloads"].items()
                },
            }
            for p in passes
        ],
        "note": args.note,
    }
    with open(RESULTS / "tp-cpu-latest.json", "w") as f:
        json.dump(out, f, indent=1)
    print(f"\nwrote {RESULTS / 'tp-cpu.md'} and {RESULTS / 'tp-cpu-latest.json'}")


if __name__ == "__main__":
    main()
