"""What the fleet endpoint's routing adds to time to first token, against one engine directly.

    python bench/router_overhead.py [--model PATH] [--rounds 6] [--num-prompts 20]
        [--max-concurrency 2] [--input-len 128] [--output-len 16] [--note TEXT]

Two servers on this host, started one after the other and both kept up, on the same model
(default: `paged serve`'s, SmolLM2-135M GGUF), the same engine flags and the same OMP threads:

- direct: `paged serve MODEL`: the server holds the AsyncEngine (its engine-core process).
- fleet: `paged serve --fleet F` with a fleet of one `cpu` replica and the default `prefix`
  router: the server holds a ReplicaSet that routes each request (block hashes of the prompt,
  PrefixIndex lookups and insert, load and speed of each candidate) to a Replica wrapping
  the same kind of AsyncEngine (its engine-core process), which measures every output for
  the router's speed estimates.

The router is in the server process: there is no extra network or process hop in either
path (server -> engine core over ZeroMQ in both). What is compared is the routing and the
Replica wrapper per request, plus whatever else differs between the two servers' processes
(the replica process is pinned to the host's cores, as every fleet replica is).

Load: `paged bench serve`'s own `benchmark()` (streamed /v1/completions, ignore_eos, random
token prompts from the server's /tokenize), --max-concurrency requests in flight. After a
warm-up pass on each, --rounds rounds; in each round both servers get the same prompts (seed
= round), in alternating order (direct first in even rounds). Each server sees each prompt
once, so prefix caching treats both alike. Figures: median and p99 TTFT of all timed
requests per server, the difference, and the per-round differences of the medians (their
spread is this host's noise). Then the router path alone, in this process, on a fake engine:
the time `ReplicaSet.generate` takes to route and wrap a request and pass its first output,
against the bare engine stream, for prompts of 128 to 8192 tokens.

Results: a section appended to bench/results/router-overhead.md, and
bench/results/router-overhead-latest.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from common import RESULTS, git_rev, machine  # noqa: E402

SERVERS = ("direct", "fleet")
MICRO_LENS = (128, 1024, 8192)


# ---- servers -------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(name: str, args: list[str], env: dict[str, str], log: Path) -> tuple:
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "paged.server", "--port", str(port), "--log-level", "warning"]
    with open(log, "w") as f:
        proc = subprocess.Popen([*cmd, *args], stdout=f, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"{name} server exited {proc.returncode}:\n{log.read_text()[-3000:]}"
            )
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop(proc)
    raise RuntimeError(f"{name} server not ready in 600 s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---- load ----------------------------------------------------------------------------------
def bench_args(url: str, opts: argparse.Namespace, seed: int, n: int) -> argparse.Namespace:
    """`paged bench serve`'s arguments, parsed by its own parser."""
    from paged.cli import bench_serve

    ap = argparse.ArgumentParser()
    bench_serve.register(ap.add_subparsers())
    argv = ["serve", "--url", url + "/v1", "--num-prompts", str(n), "--seed", str(seed)]
    argv += ["--max-concurrency", str(opts.max_concurrency), "--disable-tqdm"]
    argv += ["--random-input-len", str(opts.input_len)]
    argv += ["--random-output-len", str(opts.output_len)]
    return ap.parse_args(argv)


def run_load(url: str, opts: argparse.Namespace, seed: int, n: int) -> list[float]:
    """TTFTs (s) of n requests of `paged bench serve`'s benchmark; fails on any error."""
    from paged.cli.bench_prompts import load_prompts
    from paged.cli.bench_serve import _first_model, benchmark

    args = bench_args(url, opts, seed, n)
    args.api_key = None
    model = asyncio.run(_first_model(args))
    m = asyncio.run(benchmark(args, load_prompts(args), model))
    errors = [r["error"] for r in m["requests"] if r["error"]]
    if errors:
        raise RuntimeError(f"{url}: {len(errors)} failed requests, first: {errors[0]}")
    return [r["ttft"] for r in m["requests"]]


def run_paired(urls: dict[str, str], opts: argparse.Namespace, n: int) -> list[float]:
    """One request in flight: each prompt to both servers back to back (which goes first
    alternates), with `paged bench serve`'s send(). Returns fleet - direct TTFT per prompt (s):
    the two requests of a pair meet nearly the same background load."""
    import httpx

    from paged.cli.bench_prompts import load_prompts
    from paged.cli.bench_serve import _first_model, send

    args = bench_args(urls["direct"], opts, seed=20_000, n=n)
    args.api_key = None
    prompts = load_prompts(args)
    models = {s: asyncio.run(_first_model(bench_args(urls[s], opts, 0, 1))) for s in SERVERS}
    base = {"stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
            "temperature": 0.0}  # fmt: skip

    async def pairs() -> list[float]:
        out = []
        async with httpx.AsyncClient(timeout=600) as client:
            for i, p in enumerate(prompts):
                ttft = {}
                for s in SERVERS if i % 2 == 0 else SERVERS[::-1]:
                    body = {**base, "model": models[s], "prompt": p.prompt}
                    body["max_tokens"] = 1  # TTFT is all this pass reads
                    r = await send(client, urls[s] + "/v1/completions", body, {}, p)
                    if not r.success:
                        raise RuntimeError(f"{urls[s]}: {r.error}")
                    ttft[s] = r.ttft
                out.append(ttft["fleet"] - ttft["direct"])
        return out

    return asyncio.run(pairs())


def pct(v: list[float], q: float) -> float:
    import numpy as np

    return float(np.percentile(np.asarray(v) * 1000, q))


def paired_ci(d: list[float], n: int = 2000) -> tuple[float, float]:
    """95 % bootstrap interval (ms) of the median of paired differences."""
    import numpy as np

    rng = np.random.default_rng(0)
    x = np.asarray(d) * 1000
    lo, hi = np.percentile([np.median(rng.choice(x, x.size)) for _ in range(n)], [2.5, 97.5])
    return float(lo), float(hi)


def median_diff_ci(a: list[float], b: list[float], n: int = 2000) -> tuple[float, float]:
    """95 % bootstrap interval (ms) of median(b) - median(a), requests resampled per server."""
    import numpy as np

    rng = np.random.default_rng(0)
    x, y = np.asarray(a) * 1000, np.asarray(b) * 1000
    d = [np.median(rng.choice(y, y.size)) - np.median(rng.choice(x, x.size)) for _ in range(n)]
    lo, hi = np.percentile(d, [2.5, 97.5])
    return float(lo), float(hi)


# ---- the router path alone -----------------------------------------------------------------
class FakeEngine:
    """What a Replica reads of an AsyncEngine, with a stream of one output."""

    def __init__(self) -> None:
        self.outstanding_tokens = 0
        self.ready, self.dead, self.on_dead, self.observer = True, None, None, None
        self.tokenizer = None
        self.info = dict(max_model_len=16384, num_blocks=4096, block_size=16, pid=1,
                         platform="cpu")  # fmt: skip
        self.stats = {"prefix_cache_queries": 0, "prefix_cache_hits": 0}
        self.update = SimpleNamespace(output=SimpleNamespace(new_token_ids=[7]))

    async def generate(self, request_id, prompt_ids, params):
        yield self.update

    def silent_for(self) -> float:
        return 0.0

    def abort(self, request_id) -> None:
        pass


def micro(prompt_len: int, reps: int) -> dict[str, float]:
    """Median microseconds to the first output: bare engine stream vs ReplicaSet.generate (a
    fleet of one, prefix router), each request a new prompt (its blocks inserted)."""
    import random

    from paged.engine.replicas import Replica, ReplicaSet
    from paged.sampling.params import SamplingParams

    engine = FakeEngine()
    rs = ReplicaSet([Replica(0, engine)], same_platform=False, router="prefix")
    params = SamplingParams(max_tokens=16)
    rng = random.Random(prompt_len)
    prompts = [[rng.randrange(50_000) for _ in range(prompt_len)] for _ in range(reps)]

    async def first(stream) -> None:
        async for _ in stream:
            break
        await stream.aclose()

    async def timed(make) -> list[float]:
        out = []
        for i, p in enumerate(prompts):
            t0 = time.perf_counter()
            await first(make(f"r{i}", p))
            out.append(time.perf_counter() - t0)
        return out

    bare = asyncio.run(timed(lambda rid, p: engine.generate(rid, p, params)))
    routed = asyncio.run(timed(lambda rid, p: rs.generate(rid, p, params)))
    return {
        "bare_us": statistics.median(bare) * 1e6,
        "routed_us": statistics.median(routed) * 1e6,
        "added_us": (statistics.median(routed) - statistics.median(bare)) * 1e6,
    }


# ---- main ----------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model (default: paged serve's default)")
    ap.add_argument("--engine-args", default="", help="more engine flags, for both servers")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--num-prompts", type=int, default=20, help="per server and round")
    ap.add_argument("--max-concurrency", type=int, default=2)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--paired", type=int, default=300, help="prompts of the paired pass")
    ap.add_argument("--micro-reps", type=int, default=300)
    ap.add_argument("--note", default="", help="a line for the results section")
    ap.add_argument("--no-write", action="store_true", help="print only")
    opts = ap.parse_args()

    threads = str(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
    # The same threads for both engines; passive OpenMP waits, as the tests use: on a shared
    # host, spinning threads make steps several times slower when other processes compete.
    env = {**os.environ, "OMP_NUM_THREADS": threads, "OMP_WAIT_POLICY": "PASSIVE"}
    engine = [opts.model] if opts.model else []
    engine += opts.engine_args.split()
    tmp = Path(tempfile.mkdtemp(prefix="router-overhead-"))
    fleet = tmp / "fleet.yaml"
    fleet.write_text("replicas:\n  - {platform: cpu, count: 1}\n")
    args = {"direct": engine, "fleet": [*engine, "--fleet", str(fleet)]}
    load0 = os.getloadavg()[0]
    procs, urls = {}, {}
    try:
        for name in SERVERS:
            procs[name], urls[name] = start(name, args[name], env, tmp / f"{name}.log")
            print(f"{name}: up at {urls[name]}", flush=True)
        for name in SERVERS:  # warm-up: first requests, allocator, caches
            run_load(urls[name], opts, seed=10_000, n=max(4, opts.max_concurrency * 2))
        ttft: dict[str, list[float]] = {s: [] for s in SERVERS}
        rounds = []
        for r in range(opts.rounds):
            order = SERVERS if r % 2 == 0 else SERVERS[::-1]
            got = {s: run_load(urls[s], opts, seed=r, n=opts.num_prompts) for s in order}
            for s in SERVERS:
                ttft[s] += got[s]
            med = {s: statistics.median(got[s]) * 1000 for s in SERVERS}
            rounds.append(med)
            print(f"round {r}: median TTFT direct {med['direct']:.2f} ms, "
                  f"fleet {med['fleet']:.2f} ms", flush=True)  # fmt: skip
        paired = run_paired(urls, opts, opts.paired) if opts.paired else []
        view = json.loads(__import__("httpx").get(urls["fleet"] + "/fleet").text)
    finally:
        for p in procs.values():
            stop(p)
    load1 = os.getloadavg()[0]

    fig = {s: {"median_ttft_ms": pct(ttft[s], 50), "p99_ttft_ms": pct(ttft[s], 99),
               "mean_ttft_ms": statistics.fmean(ttft[s]) * 1000, "requests": len(ttft[s])}
           for s in SERVERS}  # fmt: skip
    added_median = fig["fleet"]["median_ttft_ms"] - fig["direct"]["median_ttft_ms"]
    added_p99 = fig["fleet"]["p99_ttft_ms"] - fig["direct"]["p99_ttft_ms"]
    diffs = sorted(m["fleet"] - m["direct"] for m in rounds)
    ci = median_diff_ci(ttft["direct"], ttft["fleet"])
    micro_rows = {n: micro(n, opts.micro_reps) for n in MICRO_LENS}
    pair_med = statistics.median(paired) * 1000 if paired else float("nan")
    pair_ci = paired_ci(paired) if paired else (float("nan"), float("nan"))

    print(f"\n{'':<8}{'median TTFT':>14}{'p99 TTFT':>12}  ({len(ttft['direct'])} requests each)")
    for s in SERVERS:
        print(f"{s:<8}{fig[s]['median_ttft_ms']:>11.2f} ms{fig[s]['p99_ttft_ms']:>9.2f} ms")
    print(f"added   {added_median:>11.2f} ms{added_p99:>9.2f} ms")
    print(f"95 % bootstrap interval of the added median: [{ci[0]:+.2f}, {ci[1]:+.2f}] ms")
    print("per-round differences of the medians (ms): " + ", ".join(f"{d:+.2f}" for d in diffs))
    print(
        f"paired pass, {len(paired)} prompts one at a time: median fleet - direct TTFT "
        f"{pair_med:+.2f} ms, 95 % interval [{pair_ci[0]:+.2f}, {pair_ci[1]:+.2f}] ms"
    )
    for n, m in micro_rows.items():
        print(f"router path alone, {n}-token prompt: {m['added_us']:.1f} us added "
              f"({m['bare_us']:.1f} -> {m['routed_us']:.1f} us)")  # fmt: skip
    if opts.no_write:
        return

    now = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    cmd = " ".join(["python", "bench/router_overhead.py", *sys.argv[1:]])
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, cwd=RESULTS.parent).stdout  # fmt: skip
    rev = git_rev() + (
        " + uncommitted changes (other engineers' work in the tree)" if dirty else ""
    )
    model = opts.model or "paged serve's default (SmolLM2-135M GGUF)"
    lines = [
        f"\n## Fleet endpoint (1 replica, prefix router) vs one engine directly ({now})\n",
        f"- machine: {machine()}",
        f"- commit: {rev}",
        f"- command: `{cmd}`",
        f"- model: {model}; engine flags: `{opts.engine_args or '(defaults)'}`, "
        f"OMP_NUM_THREADS={threads} and OMP_WAIT_POLICY=PASSIVE for both",
        f"- load: `paged bench serve`'s benchmark(), {opts.input_len}-token random prompts, "
        f"{opts.output_len} output tokens (ignore_eos), {opts.max_concurrency} in flight; "
        f"warm-up, then {opts.rounds} rounds x {opts.num_prompts} requests per server, same "
        "prompts for both in a round, alternating which goes first",
        f"- host load average (1 min) at start / end: {load0:.2f} / {load1:.2f}",
        "",
        "| server | requests | median TTFT (ms) | p99 TTFT (ms) | mean TTFT (ms) |",
        "|---|---|---|---|---|",
    ]
    for s in SERVERS:
        f = fig[s]
        lines.append(f"| {s} | {f['requests']} | {f['median_ttft_ms']:.2f} | "
                     f"{f['p99_ttft_ms']:.2f} | {f['mean_ttft_ms']:.2f} |")  # fmt: skip
    lines.append(f"| **added (fleet - direct)** | | **{added_median:+.2f}** | {added_p99:+.2f} | |")
    lines += [
        "",
        f"95 % bootstrap interval of the added median TTFT: [{ci[0]:+.2f}, {ci[1]:+.2f}] ms. "
        "Per-round differences of the median TTFT, fleet - direct (ms): "
        + ", ".join(f"{d:+.2f}" for d in diffs),
        "",
        f"Paired pass: {len(paired)} prompts one at a time (max_tokens 1), each sent to both "
        "servers back to back (which first alternates), `paged bench serve`'s send(): "
        "median of the per-prompt "
        f"differences fleet - direct {pair_med:+.2f} ms, 95 % bootstrap interval "
        f"[{pair_ci[0]:+.2f}, {pair_ci[1]:+.2f}] ms.",
        "",
        "The router path alone (this process, a fake engine whose stream yields one output): "
        "median time to the first output through `ReplicaSet.generate` (route, block hashes, "
        "PrefixIndex, Replica wrapper) against the bare stream, a new prompt each time:",
        "",
        "| prompt tokens | bare (us) | routed (us) | added (us) |",
        "|---|---|---|---|",
    ]
    for n, m in micro_rows.items():
        lines.append(f"| {n} | {m['bare_us']:.1f} | {m['routed_us']:.1f} | {m['added_us']:.1f} |")
    if opts.note:
        lines += ["", opts.note]
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / "router-overhead.md", "a") as f:
        f.write("\n".join(lines) + "\n")
    record = {"date": now, "machine": machine(), "commit": rev, "command": cmd,
              "options": vars(opts), "servers": fig, "added_median_ttft_ms": added_median,
              "added_p99_ttft_ms": added_p99, "added_median_ci95_ms": ci,
              "round_medians_ms": rounds,
              "router_path_us": micro_rows,
              "paired_diffs_ms": [d * 1000 for d in paired], "paired_median_ms": pair_med,
              "paired_ci95_ms": pair_ci, "fleet_view": view}  # fmt: skip
    with open(RESULTS / "router-overhead-latest.json", "w") as f:
        json.dump(record, f, indent=1)
    print(f"\nwrote {RESULTS / 'router-overhead.md'} and {RESULTS / 'router-overhead-latest.json'}")


if __name__ == "__main__":
    main()
