"""The H200 figures of issue 4 in one device call: ceilings, latency, throughput, serving.

    python bench/h200.py                      # everything, within --budget seconds (530)
    python bench/h200.py --phases latency --lat-output 32      # one phase, smaller

Phases (run in the order given, each in its own subprocess with a timeout, so one failure
or hang loses nothing else): ``ceilings`` (copy GB/s, bf16 matmul TFLOP/s), ``latency``
(`paged bench latency` with HF eager + static-compiled baselines), ``throughput`` (`paged
bench throughput` with HF static-compiled batch 64 and generate_batch, each HF mode held to
--tp-hf-seconds by scaling its prompt count), ``serve`` (`paged serve` + `paged bench
serve`), ``latency-eager`` (paged with --enforce-eager), ``latency-sync`` (paged with
--no-async-scheduling), ``latency-fp8`` (paged with --quantization fp8, its start-up logged:
the kernel variants compiled ahead and the GEMV timing), ``latency-fp8-wo`` (the same with
--cuda-fp8-weight-only-decode: one-row fp8 linears weight-only). Results: $OUT/h200.md (a markdown
section, also appended to bench/results/h200.md), $OUT/h200.json, logs in $OUT/logs/.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
PHASES = ("ceilings", "latency", "throughput", "serve", "latency-eager", "latency-sync", "long",
          "latency-fp8", "latency-fp8-wo")
RESERVE_S = 15  # kept back from the budget to write the results
# Floors from issue 4 (one H200, Llama-3.1-8B shape, bf16).
FLOOR_TPOT_MS, FLOOR_TP_TOK_S, FLOOR_TTFT_MS, FLOOR_ITL_MS = 5.0, 15000.0, 60.0, 10.0
FLOOR_FP8_TPOT_MS = 2.6  # issue 15: batch-1 decode with --quantization fp8
STARTUP_LINES = ("compiled", "start-up GEMV timing took")  # the fp8 run's start-up, logged


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    a = ap.add_argument
    a("--out", default=os.environ.get("OUT") or "/tmp/paged-h200", help="output folder ($OUT)")
    a("--phases", default=",".join(PHASES), help=f"comma list, in order, of {', '.join(PHASES)}")
    a("--budget", type=float, default=530, help="seconds for everything; later phases get less")
    a("--model", default="llama-3.1-8b", help="named shape (dummy weights) or a model path")
    a("--dtype", default="bfloat16")
    a("--engine-args", default="", help="extra paged engine flags for every phase, one string")
    a("--no-append", action="store_true", help="do not append to bench/results/h200.md")
    a("--copy-gib", type=float, default=4.0, help="ceilings: bytes copied device to device")
    a("--matmul-n", type=int, default=8192, help="ceilings: bf16 n x n x n matmul")
    a("--lat-batch", type=int, default=1)
    a("--lat-input", type=int, default=128)
    a("--lat-output", type=int, default=128)
    a("--lat-iters", type=int, default=5, help="paged's timed iterations")
    a("--lat-max-model-len", type=int, default=0,
      help="latency runs' --max-model-len (0: the benchmark's own, input + output; a server's "
           "length sizes its decode graphs' attention splits)")  # fmt: skip
    a("--lat-hf-iters", type=int, default=2, help="HF's timed iterations (each: TTFT + full)")
    a("--lat-hf-modes", default="eager,static")
    a("--tp-prompts", type=int, default=1000)
    a("--tp-input", type=int, default=256)
    a("--tp-output", type=int, default=256)
    a("--tp-hf-modes", default="static,batch")
    a("--tp-hf-batch-size", type=int, default=64)
    a("--tp-hf-seconds", type=float, default=45, help="time budget per HF mode (excl. warm-up)")
    a("--serve-rate", type=float, default=8.0)
    a("--serve-prompts", type=int, default=200)
    a("--serve-input", type=int, default=512)
    a("--serve-output", type=int, default=128)
    a("--serve-max-model-len", type=int, default=2048)
    for name, t in (("ceilings", 90), ("latency", 240), ("throughput", 330), ("serve", 200)):
        a(f"--{name}-timeout", type=float, default=t, help="seconds")
    a("--latency-eager-timeout", type=float, default=120, help="seconds")
    a("--latency-sync-timeout", type=float, default=120, help="seconds")
    a("--latency-fp8-timeout", type=float, default=300, help="seconds (start-up included)")
    a("--latency-fp8-wo-timeout", type=float, default=300, help="seconds (start-up included)")
    a("--long-input", type=int, default=32000, help="long: one prompt of this many tokens")
    a("--long-output", type=int, default=128)
    a("--long-timeout", type=float, default=240, help="seconds")
    a("--_ceilings", default=None, help=argparse.SUPPRESS)  # internal: the ceilings child
    return ap.parse_args(argv)


# ---- ceilings (run in a child so this process never holds GPU memory) ------------------
def ceilings(path: str, copy_gib: float, n: int) -> None:
    import torch

    def timed(fn, reps: int) -> float:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / reps

    numel = int(copy_gib * 2**30) // 2
    a = torch.empty(numel, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    copy_s = timed(functools.partial(b.copy_, a), 10)
    nbytes = a.numel() * a.element_size()
    del a, b
    x = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    y = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    mm_s = timed(functools.partial(torch.matmul, x, y), 20)
    facts = {
        "gpu": torch.cuda.get_device_name(0),
        "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "copy_bytes": nbytes,
        "copy_GBps": 2 * nbytes / copy_s / 1e9,  # read + write
        "matmul_n": n,
        "bf16_matmul_TFLOPs": 2 * n**3 / mm_s / 1e12,
    }
    for mod in ("triton", "transformers"):
        try:
            facts[mod] = __import__(mod).__version__
        except ImportError:
            facts[mod] = None
    Path(path).write_text(json.dumps(facts, indent=1))


# ---- subprocesses ------------------------------------------------------------------------
def paged(*args: object) -> list[str]:
    return [sys.executable, "-m", "paged.cli.main", *map(str, args)]


def _stop(proc: subprocess.Popen, grace: float = 20) -> None:
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            pass


def _tail(log: Path, n: int) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def run(name: str, cmd: list[str], timeout: float, logs: Path, echo: int = 30) -> int | None:
    """Run cmd with output to logs/<name>.log; a heartbeat every 30 s; None on timeout."""
    log = logs / f"{name}.log"
    print(f"[{name}] $ {shlex.join(cmd)}  (timeout {timeout:.0f} s)", flush=True)
    t0 = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=_env(), start_new_session=True
        )
        rc: int | None = None
        while (left := timeout - (time.monotonic() - t0)) > 0:
            try:
                rc = proc.wait(min(30.0, left))
                break
            except subprocess.TimeoutExpired:
                last = _tail(log, 1)[-150:]
                print(f"[{name}] {time.monotonic() - t0:.0f} s ... {last}", flush=True)
        if rc is None:
            _stop(proc)
    took = time.monotonic() - t0
    status = "TIMED OUT" if rc is None else f"exit {rc}"
    print(f"[{name}] {status} after {took:.0f} s; last lines of {log}:", flush=True)
    print(_tail(log, echo), flush=True)
    return rc


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    core = str(ROOT / "core")  # runs from a checkout even when paged is not installed
    env["PYTHONPATH"] = core + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


# ---- phases: each returns a dict of figures (and its command lines) ----------------------
def _shape(model: str) -> dict | None:
    sys.path.insert(0, str(ROOT / "core"))
    from paged.model.shapes import SHAPES

    return SHAPES.get(model.lower())


def _model_args(args) -> list[str]:
    """--model and the flags every engine gets: named shapes run on dummy weights."""
    dummy = ["--load-format", "dummy"] if _shape(args.model) else []
    return ["--model", args.model, *dummy, "--dtype", args.dtype, *shlex.split(args.engine_args)]


def phase_ceilings(args, out: Path, timeout: float) -> dict:
    path = out / "ceilings.json"
    cmd = [sys.executable, __file__, "--_ceilings", str(path), "--copy-gib", str(args.copy_gib)]
    cmd += ["--matmul-n", str(args.matmul_n)]
    rc = run("ceilings", cmd, timeout, out / "logs")
    return {"rc": rc, "commands": [shlex.join(cmd)], **_load(path)}


def _latency(args, out: Path, timeout: float, variant: str = "") -> dict:
    """variant: "" (the default engine, with the HF baselines), "eager" (no CUDA graphs),
    "sync" (no overlapped steps), "fp8" (--quantization fp8, start-up logged) or "fp8-wo" (the
    same, one-row linears weight-only): paged alone."""
    name = f"latency-{variant}" if variant else "latency"
    path = out / f"{name}.json"
    cmd = paged("bench", "latency", *_model_args(args), "--batch-size", args.lat_batch,
                "--input-len", args.lat_input, "--output-len", args.lat_output,
                "--no-enable-prefix-caching", "--num-iters-warmup", 1,
                "--num-iters", args.lat_iters, "--save-json", path, "--disable-tqdm")  # fmt: skip
    if args.lat_max_model_len:
        cmd += ["--max-model-len", str(args.lat_max_model_len)]
    if variant == "eager":
        cmd.append("--enforce-eager")
    elif variant == "sync":
        cmd.append("--no-async-scheduling")
    elif variant in ("fp8", "fp8-wo"):
        cmd += ["--quantization", "fp8", "--log-level", "info"]
        if variant == "fp8-wo":
            cmd.append("--cuda-fp8-weight-only-decode")
    elif args.lat_hf_modes:
        cmd += ["--baseline", "hf", "--hf-modes", args.lat_hf_modes, "--hf-batch-size",
                str(args.lat_batch), "--hf-num-iters", str(args.lat_hf_iters)]  # fmt: skip
    rc = run(name, cmd, timeout, out / "logs")
    res = {"rc": rc, "commands": [shlex.join(cmd)], **_load(path)}
    if variant in ("fp8", "fp8-wo"):
        log = (out / "logs" / f"{name}.log").read_text(errors="replace").splitlines()
        res["startup"] = [line.split(": ", 1)[-1] for line in log
                          if any(s in line for s in STARTUP_LINES)]  # fmt: skip
    return res


def phase_latency(args, out: Path, timeout: float) -> dict:
    return _latency(args, out, timeout)


def phase_latency_eager(args, out: Path, timeout: float) -> dict:
    return _latency(args, out, timeout, "eager")


def phase_latency_sync(args, out: Path, timeout: float) -> dict:
    return _latency(args, out, timeout, "sync")


def phase_latency_fp8(args, out: Path, timeout: float) -> dict:
    return _latency(args, out, timeout, "fp8")


def phase_latency_fp8_wo(args, out: Path, timeout: float) -> dict:
    return _latency(args, out, timeout, "fp8-wo")


def phase_long(args, out: Path, timeout: float) -> dict:
    """One long prompt, chunked by the default step budget (2048 tokens: 16 chunks for
    32,000), then decode at that depth."""
    path = out / "long.json"
    cmd = paged("bench", "latency", *_model_args(args), "--batch-size", 1,
                "--input-len", args.long_input, "--output-len", args.long_output,
                "--max-model-len", args.long_input + args.long_output,
                "--no-enable-prefix-caching", "--num-iters-warmup", 1, "--num-iters", 2,
                "--save-json", path, "--disable-tqdm")  # fmt: skip
    rc = run("long", cmd, timeout, out / "logs")
    return {"rc": rc, "commands": [shlex.join(cmd)], **_load(path)}


def phase_throughput(args, out: Path, timeout: float) -> dict:
    path = out / "throughput.json"
    cmd = paged("bench", "throughput", *_model_args(args), "--num-prompts", args.tp_prompts,
                "--input-len", args.tp_input, "--output-len", args.tp_output,
                "--save-json", path, "--disable-tqdm")  # fmt: skip
    if args.tp_hf_modes:
        cmd += ["--baseline", "hf", "--hf-modes", args.tp_hf_modes]
        cmd += ["--hf-batch-size", str(args.tp_hf_batch_size)]
        cmd += ["--hf-max-seconds", str(args.tp_hf_seconds)]
    rc = run("throughput", cmd, timeout, out / "logs")
    return {"rc": rc, "commands": [shlex.join(cmd)], **_load(path)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def shape_dir(model: str, path: Path) -> str:
    """A model directory for a named shape: its config.json, an empty weights file (dummy
    weights are drawn anyway) and a word-level tokenizer over the whole vocabulary ("t<id>").
    A bare shape name has no tokenizer, so its server streams no text to time."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from paged.model.shapes import shape_config

    cfg = shape_config(model)
    path.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(path)
    save_file({}, str(path / "model.safetensors"))
    vocab = {f"t{i}": i for i in range(cfg.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(path)
    return str(path)


def phase_serve(args, out: Path, timeout: float) -> dict:
    t0, port, logs = time.monotonic(), _free_port(), out / "logs"
    name = args.model if _shape(args.model) else Path(args.model).name
    tmp = Path(tempfile.gettempdir()) / "paged-h200-shape" / args.model
    model = shape_dir(args.model, tmp) if _shape(args.model) else args.model
    serve = paged("serve", model, *_model_args(args)[2:])  # [2:]: the model is positional
    serve += ["--max-model-len", str(args.serve_max_model_len), "--port", str(port)]
    serve += ["--served-model-name", name]
    res: dict = {"commands": [shlex.join(serve)], "model_dir": model}
    if model != args.model:
        res["model_note"] = "the named shape's config, dummy weights, a word-level tokenizer"
    print(f"[serve] $ {shlex.join(serve)}", flush=True)
    with open(logs / "serve-server.log", "w") as f:
        server = subprocess.Popen(
            serve, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=_env(), start_new_session=True
        )
    try:
        while not _healthy(f"http://127.0.0.1:{port}/health"):
            if server.poll() is not None:
                raise RuntimeError(f"paged serve exited {server.returncode}")
            if time.monotonic() - t0 > timeout * 0.6:
                raise TimeoutError("paged serve not healthy in time")
            time.sleep(1)
        res["server_ready_s"] = time.monotonic() - t0
        print(f"[serve] healthy after {res['server_ready_s']:.0f} s", flush=True)
        base = ["--url", f"http://127.0.0.1:{port}/v1", "--random-input-len", args.serve_input,
                "--random-output-len", args.serve_output, "--disable-tqdm"]  # fmt: skip
        if _shape(args.model):  # no tokenizer: random token ids
            base += ["--vocab-size", _shape(args.model)["vocab_size"]]
        run("serve-warmup", paged("bench", "serve", *base, "--num-prompts", 8), 60, logs, echo=3)
        before, counted = _scrape(f"http://127.0.0.1:{port}/metrics")
        path = out / "serve.json"
        cmd = paged("bench", "serve", *base, "--request-rate", args.serve_rate,
                    "--num-prompts", args.serve_prompts, "--save-json", path)  # fmt: skip
        res["commands"].append(shlex.join(cmd))
        left = timeout - (time.monotonic() - t0) - 25
        res["rc"] = run("serve", cmd, max(10.0, left), logs)
        res |= _load(path)
        hist, after = _scrape(f"http://127.0.0.1:{port}/metrics")
        res["server_side_mean_ms"] = _means(before, hist)
        print(f"[serve] server-side means (ms): {res['server_side_mean_ms']}", flush=True)
        res["engine_counters"] = {k: after[k] - counted.get(k, 0) for k in after}
        print(f"[serve] engine counters: {res['engine_counters']}", flush=True)
    finally:
        _stop(server)
    return res


# The server's per-request histograms whose means split a TTFT: waiting in the engine core
# before the first step that schedules the request, scheduled to first token, and the whole
# TTFT as the server sees it (from its arrival at the server's engine client).
_SPLIT = ("request_queue_time_seconds", "request_prefill_time_seconds",
          "time_to_first_token_seconds", "inter_token_latency_seconds")  # fmt: skip


# Engine counters: steps launched at a deadline, those that came late, kernels compiled.
_COUNTED = ("late_launches", "late_launches_missed", "kernel_compiles")


def _scrape(url: str) -> tuple[dict[str, tuple[float, float]], dict[str, float]]:
    """From one read of the server's /metrics: {histogram: (sum, count)} of _SPLIT and
    {counter: total} of _COUNTED."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    got: dict[str, list[float]] = {}
    counters: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        name = fam.name.removeprefix("paged:")
        if name in _COUNTED:
            counters[name] = sum(x.value for x in fam.samples if x.name.endswith("_total"))
        if name in _SPLIT:
            for sample in fam.samples:
                entry = got.setdefault(name, [0.0, 0.0])
                if sample.name.endswith("_sum"):
                    entry[0] += sample.value
                elif sample.name.endswith("_count"):
                    entry[1] += sample.value
    return {k: (v[0], v[1]) for k, v in got.items()}, counters


def _histograms(url: str) -> dict[str, tuple[float, float]]:
    """{histogram: (sum, count)} of _SPLIT from the server's /metrics."""
    return _scrape(url)[0]


def _means(before: dict, after: dict) -> dict[str, float]:
    """Mean milliseconds of each histogram over the observations between two scrapes."""
    out = {}
    for name, (total, count) in after.items():
        t0, c0 = before.get(name, (0.0, 0.0))
        if count > c0:
            out[name.removesuffix("_seconds")] = round((total - t0) / (count - c0) * 1e3, 2)
    return out


RUNNERS = {
    "ceilings": phase_ceilings,
    "latency": phase_latency,
    "throughput": phase_throughput,
    "serve": phase_serve,
    "latency-eager": phase_latency_eager,
    "latency-sync": phase_latency_sync,
    "long": phase_long,
    "latency-fp8": phase_latency_fp8,
    "latency-fp8-wo": phase_latency_fp8_wo,
}


# ---- the report --------------------------------------------------------------------------
def _f(v, fmt: str = ".2f") -> str:
    return format(v, fmt) if isinstance(v, int | float) else "n/a"


def _ok(ok: bool | None) -> str:
    return "n/a" if ok is None else ("**pass**" if ok else "**FAIL**")


def _weights_gb(model: str) -> float | None:
    """bf16 GB a decode step reads: every parameter of the shape (built on the meta device),
    of the experts of a Mixture-of-Experts layer only the top-k of each token."""
    if not _shape(model):
        return None
    from unittest.mock import MagicMock

    import torch

    from paged.model.registry import model_class
    from paged.model.shapes import shape_config

    cfg = shape_config(model)
    with torch.device("meta"):
        net = model_class(cfg)(cfg, MagicMock(), 4096)
    n = 0.0
    for name, p in net.named_parameters():
        share = 1.0
        if name.rsplit(".", 1)[-1] in ("w13", "w2"):  # stacked experts (model/moe.py)
            moe = net.get_submodule(name.rsplit(".", 1)[0])
            share = moe.top_k / moe.num_experts
        n += p.numel() * share
    return n * 2 / 1e9


def report(args, res: dict, started: str) -> str:
    c = res.get("ceilings", {})
    gpu = c.get("gpu", "unknown GPU")
    vers = ", ".join(f"{k} {c.get(k)}" for k in ("torch", "triton", "transformers") if c.get(k))
    weights = "dummy weights" if _shape(args.model) else "checkpoint weights"
    lines = [f"\n## {gpu}: {args.model} {args.dtype}, {weights} ({started})\n"]
    lines += [f"- versions: {vers or 'n/a'}; commit {_git_rev()}; budget {args.budget:.0f} s"]
    lines += [f"- command: `python {shlex.join(['bench/h200.py', *sys.argv[1:]])}`"]
    gb = _weights_gb(args.model)
    if "copy_GBps" in c:
        floor = f"; HBM floor per decode step {gb / c['copy_GBps'] * 1000:.2f} ms" if gb else ""
        lines += [
            f"- ceilings: device copy {c['copy_GBps']:.0f} GB/s ({c['copy_bytes'] / 2**30:.0f} GiB,"
            f" read+write), bf16 matmul {c['bf16_matmul_TFLOPs']:.0f} TFLOP/s at {c['matmul_n']}^3"
            + (f"; weights {gb:.2f} GB{floor}" if gb else "")
        ]
    lines += _latency_md(args, res)
    lines += _throughput_md(args, res)
    lines += _serve_md(args, res)
    lines += _long_md(args, res)
    errors = [(k, v) for k, v in res.items() if v.get("error") or v.get("rc") not in (0, None)]
    errors += [(k, {"error": "timed out"}) for k, v in res.items() if "rc" in v and v["rc"] is None]
    for k, v in errors:
        lines.append(f"- {k}: {v.get('error') or 'exit ' + str(v.get('rc'))} (see logs/{k}.log)")
    return "\n".join(lines) + "\n"


def _cmds(r: dict) -> list[str]:
    return [f"\n`{c.replace(sys.executable, 'python')}`" for c in r.get("commands", [])]


def _latency_md(args, res: dict) -> list[str]:
    lat, eag, syn = res.get("latency"), res.get("latency-eager"), res.get("latency-sync")
    fp8, fp8_wo = res.get("latency-fp8"), res.get("latency-fp8-wo")
    if not any("mean_tpot_ms" in (r or {}) for r in (lat, eag, syn, fp8, fp8_wo)):
        return []  # the phase's error line says why
    out = [
        f"\n### Latency: batch {args.lat_batch}, {args.lat_input} in / {args.lat_output} out\n",
        "| implementation | TTFT ms | decode ms/token | e2e ms | paged faster by |",
        "|---|---|---|---|---|",
    ]
    for label, r in (
        ("paged, mean", lat or {}),
        ("paged --no-async-scheduling, mean", syn or {}),
        ("paged --enforce-eager, mean", eag or {}),
        ("paged --quantization fp8, mean", fp8 or {}),
        ("paged --quantization fp8 --cuda-fp8-weight-only-decode, mean", fp8_wo or {}),
    ):
        if "mean_tpot_ms" in r:
            out.append(
                f"| {label} | {_f(r['mean_ttft_ms'])} | {_f(r['mean_tpot_ms'])} "
                f"| {_f(r['mean_e2el_ms'], '.1f')} | |"
            )
    for mode, r in (lat or {}).get("hf", {}).items():
        label = {"eager": "HF generate, eager", "static": "HF generate, static cache"}.get(
            mode, mode
        )
        if mode == "static":
            label += f" ({'compiled' if r.get('compiled') else 'NOT compiled'}, "
            label += f"compile ~{_f(r.get('compile_s'), '.0f')} s untimed)"
        out.append(
            f"| {label}, best of {r.get('num_iters')} | {_f(r['ttft_ms'])} | {_f(r['tpot_ms'])} "
            f"| {_f(r['e2el_ms'], '.1f')} | {_f(r.get('paged_speedup'))}x |"
        )
    for mode, why in (lat or {}).get("hf_skipped", {}).items():
        out.append(f"| HF {mode} | skipped: {why} | | | |")
    tpot = (lat or {}).get("mean_tpot_ms")
    ok = None if tpot is None else tpot <= FLOOR_TPOT_MS
    out.append(f"\nfloor: decode <= {FLOOR_TPOT_MS} ms/token: {_ok(ok)}")
    for label, r in (("", fp8), (", weight-only decode", fp8_wo)):
        if not r:
            continue
        tpot = r.get("mean_tpot_ms")
        ok = None if tpot is None else tpot <= FLOOR_FP8_TPOT_MS
        out.append(f"\nfp8 floor (issue 15){label}: decode <= {FLOOR_FP8_TPOT_MS} ms/token: "
                   f"{_ok(ok)}")  # fmt: skip
        out += [f"\n- fp8{label} start-up: {line}" for line in r.get("startup", [])]
    runs = (lat, syn, eag, fp8, fp8_wo)
    return out + [c for r in runs for c in _cmds(r or {})]


def _throughput_md(args, res: dict) -> list[str]:
    tp = res.get("throughput")
    if not tp or "total_tokens_per_s" not in tp:
        return []
    out = [
        f"\n### Throughput: {args.tp_prompts} prompts, {args.tp_input} in / {args.tp_output} out,"
        " ignore_eos\n",
        "| implementation | prompts | batch | output tok/s | total tok/s | paged faster by |",
        "|---|---|---|---|---|---|",
    ]
    if "total_tokens_per_s" in tp:
        out.append(
            f"| paged | {tp['num_requests']} | continuous | {_f(tp['output_tokens_per_s'], '.0f')} "
            f"| {_f(tp['total_tokens_per_s'], '.0f')} | |"
        )
    for mode, r in tp.get("hf", {}).items():
        label = {"static": "HF generate, static cache", "batch": "HF generate_batch"}.get(
            mode, mode
        )
        label = {"eager": "HF generate, eager"}.get(mode, label)
        if mode == "static":
            label += f" ({'compiled' if r.get('compiled') else 'NOT compiled'})"
        if mode == "batch":
            label += f" (start-up {_f(r.get('startup_s'), '.1f')} s untimed)"
        out.append(
            f"| {label} | {r['num_prompts']} | {r['batch_size']} "
            f"| {_f(r['output_tokens_per_s'], '.0f')} | {_f(r['total_tokens_per_s'], '.0f')} "
            f"| {_f(r.get('paged_speedup'))}x |"
        )
    for mode, why in tp.get("hf_skipped", {}).items():
        out.append(f"| HF {mode} | skipped: {why} | | | | |")
    tps = tp.get("total_tokens_per_s")
    ok = None if tps is None else tps >= FLOOR_TP_TOK_S
    out.append(f"\nfloor: >= {FLOOR_TP_TOK_S:.0f} total tokens/s: {_ok(ok)}")
    return out + _cmds(tp)


def _serve_md(args, res: dict) -> list[str]:
    s = res.get("serve")
    if not s or "median_ttft_ms" not in s:
        return []
    out = [
        f"\n### Serving: {args.serve_prompts} requests at {args.serve_rate}/s, "
        f"{args.serve_input} in / {args.serve_output} out\n",
        "| completed | failed | median TTFT ms | p99 TTFT ms | median ITL ms | median TPOT ms "
        "| output tok/s |",
        "|---|---|---|---|---|---|---|",
        f"| {s.get('completed', 'n/a')} | {s.get('failed', 'n/a')} | {_f(s.get('median_ttft_ms'))} "
        f"| {_f(s.get('p99_ttft_ms'))} | {_f(s.get('median_itl_ms'))} "
        f"| {_f(s.get('median_tpot_ms'))} | {_f(s.get('output_throughput'), '.0f')} |",
    ]
    ttft, itl = s.get("median_ttft_ms"), s.get("median_itl_ms")
    ok = None if ttft is None or itl is None else ttft <= FLOOR_TTFT_MS and itl <= FLOOR_ITL_MS
    out.append(
        f"\nfloor: median TTFT <= {FLOOR_TTFT_MS:.0f} ms and median ITL <= {FLOOR_ITL_MS:.0f} ms"
        f" (no failed requests): {_ok(ok and not s.get('failed'))}"
    )
    if s.get("model_note"):
        out.append(f"\nserved: {s['model_note']}")
    return out + _cmds(s)


def _long_md(args, res: dict) -> list[str]:
    r = res.get("long")
    if not r or "mean_ttft_ms" not in r:
        return []
    chunks = -(-args.long_input // 2048)
    return [
        f"\n### One long prompt: {args.long_input} in ({chunks} prefill chunks of 2048) / "
        f"{args.long_output} out, batch 1\n",
        "| TTFT ms | decode ms/token at that depth | e2e ms |",
        "|---|---|---|",
        f"| {_f(r['mean_ttft_ms'])} | {_f(r['mean_tpot_ms'])} | {_f(r['mean_e2el_ms'], '.1f')} |",
    ] + _cmds(r)


def _git_rev() -> str:
    try:
        r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, cwd=ROOT)
        return r.stdout.decode().strip() or "?"
    except OSError:
        return "?"


def save(args, out: Path, res: dict, started: str, final: bool) -> None:
    md = report(args, res, started)
    (out / "h200.md").write_text(md)
    record = {"date": started, "argv": sys.argv, "args": vars(args), "results": res}
    (out / "h200.json").write_text(json.dumps(record, indent=1, default=str))
    if final and not args.no_append:
        try:
            RESULTS.mkdir(exist_ok=True)
            with open(RESULTS / "h200.md", "a") as f:
                f.write(md)
            (RESULTS / "h200-latest.json").write_text(json.dumps(record, indent=1, default=str))
        except OSError as e:
            print(f"could not write {RESULTS}: {e}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args._ceilings:
        ceilings(args._ceilings, args.copy_gib, args.matmul_n)
        return 0
    deadline = time.monotonic() + args.budget
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    bad = [p for p in phases if p not in RUNNERS]
    if bad:
        print(f"unknown phases {bad}; choose from {', '.join(PHASES)}", file=sys.stderr)
        return 2
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    started = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    res: dict[str, dict] = {}
    for phase in phases:
        left = deadline - time.monotonic() - RESERVE_S
        timeout = min(getattr(args, f"{phase.replace('-', '_')}_timeout"), left)
        if left < 20:
            res[phase] = {"error": f"skipped: only {left:.0f} s left of --budget"}
            print(f"[{phase}] skipped: out of time", flush=True)
            continue
        t0 = time.monotonic()
        try:
            res[phase] = RUNNERS[phase](args, out, timeout)
        except Exception as e:  # one phase failing must not lose the others
            res[phase] = {**res.get(phase, {}), "error": f"{type(e).__name__}: {e}"}
            print(f"[{phase}] failed: {type(e).__name__}: {e}", flush=True)
        res[phase]["phase_s"] = time.monotonic() - t0
        save(args, out, res, started, final=False)  # a later kill still leaves these
    save(args, out, res, started, final=True)
    print((out / "h200.md").read_text(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
