"""The serving path's own cost, without a model: `paged serve` in front of a fake engine core.

    python bench/serve_overhead.py [--variants h11-asyncio,httptools-uvloop]
        [--clients bench,httpx,raw]
        [--rates 32] [--repeats 3] [--num-prompts 600] [--step-ms 6] [--pin] [--json PATH]
    python bench/serve_overhead.py --core overlap --clients raw \
        --variants httptools-uvloop,httptools-uvloop:--no-late-launch

The server is the real one (serve_main: the app, Serving, metrics, AsyncEngine) started in
its own process; only its engine core differs: `fake_core_main`, spawned by FakeCoreEngine
(an AsyncEngine whose `_process` targets it), speaks the core's protocol (Ready, one Outputs
per step with the stats /metrics exports, Alive heartbeats; Add, Abort, Shutdown) and every
--step-ms emits one token per running sequence, a step that admits new requests taking
--prefill-ms-per-1k longer per 1,000 of their prompt tokens. It sleeps between steps.
`--core overlap` instead runs the real core loop over overlapped steps on a simulated device
(bench/overlap_core.py): what late launch (`--no-late-launch` in a variant's flags) changes.

Variants pick the HTTP protocol and event loop the server finds installed: h11 / asyncio are
what it falls back to when httptools / uvloop cannot be imported (blocked in that process).
Clients: `paged bench serve`'s own benchmark() and send() (`bench`: aiohttp), or the same
benchmark() with another send(): on httpx (`httpx`, what paged bench serve used before), or a
lean one on raw asyncio streams that parses only what it needs (`raw`), which shows how much
of the gap is the client.

Per run: client TTFT (median, mean, p99) and median ITL; the server's own TTFT mean from
/metrics (AsyncEngine.generate's start to its first token); from a middleware added here, the
mean time from the ASGI app being called to generate's start and to the first body chunk
written, which splits the gap client - server into the app before generate, the first
token's way out, and the client side (the client, the kernel, uvicorn before the app); the
CPU seconds of the server process (not its core) and of the client per streamed token; CPU
used on the host by anything else meanwhile. Results: a markdown table on stdout, --json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import dataclasses
import json
import os
import random
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = {  # name -> (HTTP protocol, event loop)
    "h11-asyncio": ("h11", "asyncio"),
    "httptools-asyncio": ("httptools", "asyncio"),
    "h11-uvloop": ("h11", "uvloop"),
    "httptools-uvloop": ("httptools", "uvloop"),
}


# ---- the fake engine core (its own process) ----------------------------------------------
@dataclasses.dataclass
class FakeSpec:
    step_s: float
    prefill_s_per_token: float
    vocab_size: int
    eos_token_ids: list[int]
    max_model_len: int
    core: str = "fake"  # or "overlap": bench/overlap_core.py
    host_s: float = 0.0  # overlap: the host's time to schedule and launch a step
    jitter: float = 0.0  # overlap: relative spread (sd) of a step's device time


@dataclasses.dataclass
class _Seq:
    request_id: str
    prompt_len: int
    max_tokens: int
    ignore_eos: bool
    min_tokens: int
    rng: random.Random
    produced: int = 0


def fake_core_main(config: Any, addr_in: str, addr_out: str, log_level: str, parent: int | None,
                   faults: Any, placement: Any, spec: FakeSpec) -> None:  # fmt: skip
    """_core_main's protocol without a model: Ready, then one Outputs per step of spec.step_s
    (plus prefill time for the requests it admits), one token per running sequence."""
    from overlap_core import NUM_BLOCKS, core_process, core_stats

    from paged.engine import async_engine as ae
    from paged.engine import messages as m
    from paged.engine.request import sequence_ids

    _, pull, push = core_process(log_level, parent, addr_in, addr_out)
    encode, decode = m.encoder().encode, m.to_engine_decoder().decode
    info = m.EngineInfo(spec.max_model_len, spec.vocab_size, config.model, NUM_BLOCKS,
                        config.block_size, os.getpid(), "fake", str(config.dtype),
                        spec.eos_token_ids)  # fmt: skip
    push.send(encode(m.Ready(info)))
    seqs: dict[str, _Seq] = {}
    waiting: dict[str, float] = {}  # request id -> arrival, until its first step
    totals = {"prompt_tokens": 0, "generation_tokens": 0}
    eos = set(spec.eos_token_ids)
    beat = time.monotonic()

    def stats() -> dict[str, float]:
        return core_stats(seqs.values(), config.block_size, totals)

    while True:
        if parent is not None and os.getppid() != parent:
            return
        got, timeout = False, 0 if seqs else 1000
        while pull.poll(timeout):
            msg = decode(pull.recv())
            if type(msg) is m.Add:
                for r in msg.requests:
                    p, plen = r.params, len(r.prompt_token_ids)
                    most = p.max_tokens or spec.max_model_len - plen
                    for sid in sequence_ids(r.request_id, p.num_sequences):
                        seqs[sid] = _Seq(r.request_id, plen, most, p.ignore_eos, p.min_tokens,
                                         random.Random(sid))  # fmt: skip
                    waiting[r.request_id] = time.time()
            elif type(msg) is m.Abort:
                for sid in msg.request_ids:
                    seqs.pop(sid, None)
            elif type(msg) is m.Shutdown:
                push.close(linger=1000)
                return
            timeout, got = 0, True
        now = time.monotonic()
        if now - beat >= ae.HEARTBEAT_S:
            push.send(encode(m.Alive()))
            beat = now
        if not seqs:
            if got:
                push.send(encode(m.Outputs([], stats(), {})))
            continue
        t = time.time()
        queue_times = {rid: t - t0 for rid, t0 in waiting.items()}
        new = [s for s in seqs.values() if s.request_id in waiting and s.produced == 0]
        prompt = sum({s.request_id: s.prompt_len for s in new}.values())
        waiting.clear()
        time.sleep(max(0.0, now + spec.step_s + spec.prefill_s_per_token * prompt
                       - time.monotonic()))  # fmt: skip
        totals["prompt_tokens"] += prompt
        outs = []
        for sid, s in list(seqs.items()):
            tok = s.rng.randrange(spec.vocab_size)
            s.produced += 1
            reason = "length" if s.produced >= s.max_tokens else None
            if not s.ignore_eos and tok in eos and s.produced > s.min_tokens:
                reason = "stop"
            if reason is not None:
                del seqs[sid]
            outs.append(m.EngineOutput(sid, [tok], reason is not None, reason, None,
                                       s.prompt_len, 0))  # fmt: skip
        totals["generation_tokens"] += len(outs)
        push.send(encode(m.Outputs(outs, stats(), queue_times)))


# The timeline of the /v1/completions request being served (set by Timeline): when the app
# was called, when its engine request was sent (FakeCoreEngine._send), its first chunk written.
_TIMES: contextvars.ContextVar[dict[str, float] | None] = contextvars.ContextVar(
    "bench_times", default=None
)


def _fake_engine_class(spec: FakeSpec) -> type:
    from paged.engine import messages as m
    from paged.engine.async_engine import AsyncEngine

    class FakeCoreEngine(AsyncEngine):
        """An AsyncEngine whose core process is fake_core_main."""

        def _process(self, args: tuple) -> Any:
            import multiprocessing

            from overlap_core import overlap_core_main

            mp = multiprocessing.get_context("spawn")
            target = overlap_core_main if spec.core == "overlap" else fake_core_main
            return mp.Process(target=target, args=(*args, spec), name=self.name)

        def _send(self, msg: Any) -> None:
            times = _TIMES.get()
            if times is not None and type(msg) is m.Add:  # generate() has started
                times.setdefault("generate", time.perf_counter())
            super()._send(msg)

    return FakeCoreEngine


class Timeline:
    """ASGI middleware: per streamed /v1/completions request, seconds from the app being
    called to its engine request (`generate`) and to its first body chunk written (`chunk`);
    GET /_bench/timeline returns them (and forgets them)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.done: list[dict[str, float]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != "/v1/completions":
            if scope["type"] == "http" and scope["path"] == "/_bench/timeline":
                body, self.done = json.dumps(self.done).encode(), []
                head = [(b"content-type", b"application/json")]
                await send({"type": "http.response.start", "status": 200, "headers": head})
                return await send({"type": "http.response.body", "body": body})
            return await self.app(scope, receive, send)
        t0, times = time.perf_counter(), {}
        _TIMES.set(times)  # this request's task, and the tasks it starts, see it

        async def timed(msg: dict[str, Any]) -> None:
            await send(msg)
            if "chunk" not in times and msg["type"] == "http.response.body" and msg.get("body"):
                times["chunk"] = time.perf_counter()

        await self.app(scope, receive, timed)
        if "chunk" in times and "generate" in times:
            self.done.append({k: v - t0 for k, v in times.items()})


def serve_child(argv: list[str]) -> int:
    """`_serve VARIANT STEP_MS PREFILL_MS_PER_1K CORE HOST_MS JITTER -- paged serve args`:
    serve_main with the fake core (CORE fake or overlap), the Timeline middleware and, per the
    variant, httptools / uvloop made unimportable."""
    variant, step_ms, prefill_ms, core, host_ms, jitter, _, *serve_argv = argv
    http, loop = VARIANTS[variant]
    if http == "h11":
        sys.modules["httptools"] = None  # type: ignore[assignment]  # as if not installed
    if loop == "asyncio":
        sys.modules["uvloop"] = None  # type: ignore[assignment]
    import paged.engine.replicas as replicas
    import paged.server.app as app_mod
    from paged.server.api import add_serve_args, serve_main

    parser = argparse.ArgumentParser(prog="paged serve")
    add_serve_args(parser)
    args = parser.parse_args(serve_argv)
    cfg = json.loads((Path(args.model) / "config.json").read_text())
    eos = cfg.get("eos_token_id")
    spec = FakeSpec(float(step_ms) / 1e3, float(prefill_ms) / 1e6, cfg["vocab_size"],
                    eos if isinstance(eos, list) else [eos] if eos is not None else [],
                    args.max_model_len or cfg["max_position_embeddings"], core,
                    float(host_ms) / 1e3, float(jitter))  # fmt: skip
    replicas.AsyncEngine = _fake_engine_class(spec)  # what make_engine builds
    build = app_mod.build_app
    app_mod.build_app = lambda state: Timeline(build(state))
    return serve_main(args)


# ---- the lean client ---------------------------------------------------------------------
class RawSender:
    """bench_serve.send's contract on raw asyncio streams (keep-alive connections reused):
    JSON is parsed only for the usage chunk; a chunk counts when its text is not empty."""

    def __init__(self, url: str) -> None:
        from urllib.parse import urlparse

        u = urlparse(url)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def _conn(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        while self.idle:
            r, w = self.idle.pop()
            if not r.at_eof() and not w.is_closing():
                return r, w
            w.close()
        return await asyncio.open_connection(self.host, self.port)

    async def send(self, client: Any, url: str, payload: dict, headers: dict, prompt: Any) -> Any:
        from urllib.parse import urlparse

        from paged.cli.bench_serve import Result, finish

        res = Result(prompt.prompt_len)
        body = json.dumps(payload).encode()
        lines = [f"POST {urlparse(url).path} HTTP/1.1", f"Host: {self.host}",
                 *(f"{k}: {v}" for k, v in headers.items()),  # the API key, if any
                 "Content-Type: application/json", f"Content-Length: {len(body)}",
                 "", ""]  # fmt: skip
        head = "\r\n".join(lines).encode()
        start = last = time.perf_counter()
        chunks, usage = 0, None
        try:
            r, w = await self._conn()
            w.write(head + body)
            status = await r.readline()
            while (await r.readline()) not in (b"\r\n", b""):
                pass
            if b" 200 " not in status:
                res.error = f"HTTP {status.decode(errors='replace').strip()}"
                w.close()
                return res
            while size := int((await r.readline()).split(b";")[0], 16):
                data = await r.readexactly(size + 2)
                for event in data.split(b"\n\n"):
                    if not event.startswith(b"data: ") or event == b"data: [DONE]":
                        continue
                    if b'"usage":{' in event:
                        usage = json.loads(event[6:])["usage"]
                    if b'"text":"' in event and b'"text":""' not in event:
                        now = time.perf_counter()
                        if chunks == 0:
                            res.ttft = now - start
                        else:
                            res.itl.append(now - last)
                        last, chunks = now, chunks + 1
            await r.readline()  # the chunked body's last CRLF
            self.idle.append((r, w))
            finish(res, last - start, chunks, usage)
        except Exception as e:
            res.error = f"{type(e).__name__}: {e}"
        return res


class HttpxSender:
    """bench_serve.send's contract on httpx (paged bench serve's client before aiohttp)."""

    def __init__(self) -> None:
        import httpx

        self.client = httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=None))

    async def send(self, client: Any, url: str, payload: dict, headers: dict, prompt: Any) -> Any:
        from paged.cli.bench_serve import Result, finish

        res = Result(prompt.prompt_len)
        start = last = time.perf_counter()
        chunks, usage = 0, None
        try:
            async with self.client.stream("POST", url, json=payload, headers=headers) as resp:
                if resp.status_code != 200:
                    res.error = f"HTTP {resp.status_code}"
                    return res
                async for line in resp.aiter_lines():
                    if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                        continue
                    chunk = json.loads(line[5:])
                    usage = chunk.get("usage") or usage
                    choices = chunk.get("choices") or []
                    if choices and choices[0].get("text"):
                        now = time.perf_counter()
                        if chunks == 0:
                            res.ttft = now - start
                        else:
                            res.itl.append(now - last)
                        last, chunks = now, chunks + 1
            finish(res, last - start, chunks, usage)
        except Exception as e:
            res.error = f"{type(e).__name__}: {e}"
        return res


# ---- one measured run --------------------------------------------------------------------
def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads) from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _host_busy_s() -> float:
    """CPU seconds the whole host has spent busy (all cores), from /proc/stat."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(f[:8]) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK")  # less idle and iowait


def wait_quiet(below: float, most_s: float) -> float:
    """Wait (at most most_s) until the host's other work uses less than `below` cores over a
    second; seconds waited."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < most_s:
        busy = _host_busy_s()
        time.sleep(1.0)
        if _host_busy_s() - busy < below:
            break
    return time.monotonic() - t0


def _self_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _mean_ms(seconds: list[float]) -> float | None:
    return statistics.fmean(seconds) * 1e3 if seconds else None


def _get(url: str) -> Any:
    import httpx

    r = httpx.get(url, timeout=10)
    r.raise_for_status()
    return r.json() if "json" in r.headers.get("content-type", "") else r.text


def client_args(args: argparse.Namespace, url: str, seed: int, rate: float) -> argparse.Namespace:
    from paged.cli import bench_serve

    p = argparse.ArgumentParser()
    bench_serve.register(p.add_subparsers())
    return p.parse_args(["serve", "--url", url + "/v1", "--num-prompts", str(args.num_prompts),
                         "--request-rate", str(rate), "--random-input-len", str(args.input_len),
                         "--random-output-len", str(args.output_len), "--vocab-size",
                         str(args.vocab_size), "--seed", str(seed), "--disable-tqdm"])  # fmt: skip


def measure(args: argparse.Namespace, url: str, pids: tuple[int, int], client: str, seed: int,
            rate: float) -> dict[str, Any]:  # fmt: skip
    """One benchmark() pass against a running server, and what it cost."""
    from h200 import _means, _scrape

    from paged.cli import bench_serve
    from paged.cli.bench_prompts import random_prompts

    cargs = client_args(args, url, seed, rate)
    prompts = random_prompts(cargs)
    _get(url + "/_bench/timeline")
    before, counted = _scrape(url + "/metrics")
    cpu0 = [_cpu_s(p) for p in pids] + [_self_cpu_s(), _host_busy_s()]
    send = bench_serve.send
    if client == "raw":
        bench_serve.send = RawSender(url).send  # type: ignore[assignment]
    elif client == "httpx":
        bench_serve.send = HttpxSender().send  # type: ignore[assignment]
    try:
        res = asyncio.run(bench_serve.benchmark(cargs, prompts, args.model_name))
    finally:
        bench_serve.send = send  # type: ignore[assignment]
    cpu1 = [_cpu_s(p) for p in pids] + [_self_cpu_s(), _host_busy_s()]
    server_s, core_s, client_s, host_s = (b - a for a, b in zip(cpu0, cpu1))
    hist, after = _scrape(url + "/metrics")
    means = _means(before, hist)
    late = {k: v - counted.get(k, 0) for k, v in after.items()}
    times = _get(url + "/_bench/timeline")
    toks = max(res["total_output_tokens"], 1)
    out = {k: res[k] for k in ("completed", "failed", "duration_s", "total_output_tokens",
                               "median_ttft_ms", "mean_ttft_ms", "p99_ttft_ms",
                               "median_itl_ms", "mean_itl_ms", "median_tpot_ms")}  # fmt: skip
    out |= {
        "server_ttft_mean_ms": means.get("time_to_first_token"),
        "server_queue_mean_ms": means.get("request_queue_time"),
        "first_chunk_mean_ms": _mean_ms([t["chunk"] for t in times]),
        "to_generate_mean_ms": _mean_ms([t["generate"] for t in times]),
        "server_cpu_us_per_token": server_s / toks * 1e6,
        "server_cpu_util": server_s / res["duration_s"],
        "core_cpu_util": core_s / res["duration_s"],
        "client_cpu_us_per_token": client_s / toks * 1e6,
        "other_cpu_util": max(0.0, host_s - server_s - core_s - client_s) / res["duration_s"],
        "errors": sorted({r["error"] for r in res["requests"] if r["error"]})[:3],
        "late_launches": late.get("late_launches"),
        "late_launches_missed": late.get("late_launches_missed"),
    }
    if out["server_ttft_mean_ms"] is not None:
        out["gap_mean_ms"] = out["mean_ttft_ms"] - out["server_ttft_mean_ms"]
    if None not in (out["first_chunk_mean_ms"], out["server_ttft_mean_ms"]):
        out["client_side_mean_ms"] = out["mean_ttft_ms"] - out["first_chunk_mean_ms"]
        out["after_token_mean_ms"] = (out["first_chunk_mean_ms"] - out["to_generate_mean_ms"]
                                      - out["server_ttft_mean_ms"])  # fmt: skip
    return out


# ---- the server's lifetime ---------------------------------------------------------------
def start_server(args: argparse.Namespace, variant: str, model: str, log: Path) -> tuple:
    """The server of `variant` (VARIANT@base: with paged imported from --base-core)."""
    from h200 import _free_port, _healthy

    port = _free_port()
    variant, _, flags = variant.partition(":")
    name, _, base = variant.partition("@")
    cmd = [sys.executable, __file__, "_serve", name, str(args.step_ms),
           str(args.prefill_ms_per_1k), args.core, str(args.host_ms),
           str(args.step_jitter), "--", model,
           "--max-model-len", "2048", "--port", str(port), "--served-model-name",
           args.model_name, *flags.split()]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if base:
        env["PYTHONPATH"] = str(Path(args.base_core).resolve())
    f = open(log, "w")  # noqa: SIM115 (kept open for the server's lifetime)
    proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    if args.pin:  # the server (and the core it starts) on a CPU of its own
        os.sched_setaffinity(proc.pid, {args.server_cpu})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while not _healthy(url + "/health"):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the server did not start:\n{log.read_text()[-2000:]}")
        time.sleep(0.25)
    core = _get(url + "/fleet")["replicas"][0]["pid"]
    return proc, url, core, f


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# ---- the report --------------------------------------------------------------------------
COLUMNS = [  # (key, header, format)
    ("median_ttft_ms", "client TTFT median", ".2f"),
    ("mean_ttft_ms", "client TTFT mean", ".2f"),
    ("p99_ttft_ms", "client TTFT p99", ".1f"),
    ("median_itl_ms", "client ITL median", ".2f"),
    ("server_ttft_mean_ms", "server TTFT mean", ".2f"),
    ("gap_mean_ms", "gap mean (client - server)", ".2f"),
    ("to_generate_mean_ms", "app to generate mean", ".2f"),
    ("after_token_mean_ms", "1st token to chunk mean", ".2f"),
    ("client_side_mean_ms", "client side mean", ".2f"),
    ("server_cpu_us_per_token", "server CPU us/token", ".0f"),
    ("server_cpu_util", "server CPU (cores)", ".2f"),
    ("client_cpu_us_per_token", "client CPU us/token", ".0f"),
    ("other_cpu_util", "other host CPU (cores)", ".2f"),
]


def _cell(vals: list[float], fmt: str) -> str:
    """The median of the runs, with their range when there are several."""
    if not vals:
        return "n/a"
    mid = format(statistics.median(vals), fmt)
    return mid if len(vals) == 1 else f"{mid} ({format(min(vals), fmt)}-{format(max(vals), fmt)})"


def table(runs: list[dict[str, Any]]) -> str:
    keys = list(dict.fromkeys((r["variant"], r["client"], r["rate"]) for r in runs))
    head = ["variant", "client", "req/s", "runs", *(h for _, h, _ in COLUMNS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for v, c, rate in keys:
        rs = [r for r in runs if (r["variant"], r["client"], r["rate"]) == (v, c, rate)]
        cells = [_cell([r[k] for r in rs if r.get(k) is not None], f) for k, _, f in COLUMNS]
        lines.append("| " + " | ".join([v, c, f"{rate:g}", str(len(rs)), *cells]) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    a = ap.add_argument
    a(
        "--variants",
        default="h11-asyncio,httptools-uvloop",
        help=f"comma list of {', '.join(VARIANTS)} (each may end in @base, then in "
        "':FLAGS', paged serve flags for that server, e.g. ':--no-late-launch')",
    )
    a(
        "--base-core",
        default=None,
        help="a VARIANT@base in --variants runs paged from this folder (say an exported "
        "`git archive HEAD core`), to compare with another version of the code",
    )
    a("--clients", default="bench", help="comma list of bench (paged bench serve's), httpx, raw")
    a("--rates", default="32", help="comma list of request rates (req/s)")
    a("--repeats", type=int, default=3, help="rounds; each round runs every variant, in turn")
    a("--num-prompts", type=int, default=600)
    a("--input-len", type=int, default=512)
    a("--output-len", type=int, default=128)
    a("--step-ms", type=float, default=6.0, help="the fake core's step time")
    a("--prefill-ms-per-1k", type=float, default=20.0,
      help="added to a step per 1,000 prompt tokens it admits")  # fmt: skip
    a("--core", choices=("fake", "overlap"), default="fake",
      help="fake: a loop of its own, steps one after another; overlap: the real core loop "
      "(late launch included) over overlapped steps on a simulated device (overlap_core.py)")
    a("--host-ms", type=float, default=0.5, help="overlap: host time to schedule and launch")
    a("--step-jitter", type=float, default=0.0,
      help="overlap: a step's device time times a normal factor of mean 1 and this sd")
    a("--model", default="llama-3.1-8b", help="named shape: its config and vocabulary")
    a("--warmup", type=int, default=16, help="requests before the timed ones, per server")
    a(
        "--quiet-below",
        type=float,
        default=0.3,
        help="before each run, wait until the host's other work uses fewer cores than this",
    )
    a("--quiet-wait", type=float, default=60.0, help="longest wait for that (s)")
    a(
        "--pin",
        action="store_true",
        help="pin the server and its core to the last CPU, the client to the others",
    )
    a("--json", default=None, help="write every run's figures here")
    a("--log-dir", default=None, help="server logs (default: $TMPDIR/paged-serve-overhead/logs)")
    return ap.parse_args(argv)


def main(argv: list[str]) -> int:
    if argv[:1] == ["_serve"]:
        return serve_child(argv[1:])
    args = parse_args(argv)
    from h200 import _shape, shape_dir

    sys.path.insert(0, str(ROOT / "core"))
    tmp = Path(tempfile.gettempdir()) / "paged-serve-overhead"  # rewritten by each run
    logs = Path(args.log_dir) if args.log_dir else tmp / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    model = shape_dir(args.model, tmp / args.model)
    args.model_name, args.vocab_size = args.model, _shape(args.model)["vocab_size"]
    if args.pin:  # this process (the client) on the other CPUs
        cpus = os.sched_getaffinity(0)
        args.server_cpu = max(cpus)
        os.sched_setaffinity(0, cpus - {args.server_cpu})
    variants = args.variants.split(",")
    clients, rates = args.clients.split(","), [float(r) for r in args.rates.split(",")]
    runs: list[dict[str, Any]] = []
    for rnd in range(args.repeats):
        order = variants if rnd % 2 == 0 else variants[::-1]  # ABBA: drift hits both alike
        for v in order:
            proc, url, core, f = start_server(args, v, model, logs / f"server-{v}-{rnd}.log")
            try:
                warm = dict(vars(args), num_prompts=args.warmup)
                measure(argparse.Namespace(**warm), url, (proc.pid, core), "bench", 99, 32)
                for rate in rates:
                    for c in clients:
                        waited = wait_quiet(args.quiet_below, args.quiet_wait)
                        r = measure(args, url, (proc.pid, core), c, rnd, rate)
                        r |= {"variant": v, "client": c, "rate": rate, "round": rnd,
                              "waited_quiet_s": waited}  # fmt: skip
                        runs.append(r)
                        print(json.dumps({k: round(x, 3) if isinstance(x, float) else x
                                          for k, x in r.items()}), flush=True)  # fmt: skip
            finally:
                stop_server(proc)
                f.close()
    print(table(runs))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "argv": sys.argv,
                                               "runs": runs}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":  # guarded: the spawned core process imports this module
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main(sys.argv[1:]))
