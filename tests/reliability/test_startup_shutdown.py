"""SIGTERM drains within --shutdown-timeout and exits 0; start-up errors are clear and early."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from reliability_helpers import QUIET_OMP, TINY_ARGS, check_error, start_server, stop_server

from paged.config import EngineConfig


def stream_events(url: str, body: dict, out: dict[str, object]) -> None:
    """Collect a stream's data events into out["events"] (out["error"] if it broke off)."""
    events: list[str] = []
    out["events"] = events
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            for ln in r.iter_lines():
                if ln.startswith("data: "):
                    events.append(ln[6:])
    except httpx.HTTPError as e:
        out["error"] = e


def test_sigterm_drains_then_exits_zero(tiny_model, tmp_path):
    # 50 ms a step: the short stream ends in ~1 s, the long one would need ~10 s
    srv = start_server([tiny_model, *TINY_ARGS, "--shutdown-timeout", "3"],
                       tmp_path / "server.log", {"PAGED_TEST_STEP_DELAY": "0.05"})  # fmt: skip
    try:
        short: dict[str, object] = {}
        long: dict[str, object] = {}
        body = {"prompt": [5, 6], "ignore_eos": True, "stream": True}
        threads = [
            threading.Thread(target=stream_events, args=(srv.url, body | {"max_tokens": n}, o))
            for n, o in ((20, short), (200, long))
        ]
        for t in threads:
            t.start()
        time.sleep(0.5)  # both in flight
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        assert httpx.get(srv.url + "/health", timeout=5).status_code == 503
        late = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi"}, timeout=5)
        assert "shutting down" in check_error(late, 503)["message"]
        assert srv.proc.wait(timeout=30) == 0
        took = time.monotonic() - t0
        for t in threads:
            t.join(10)
        assert short["events"][-1] == "[DONE]", short  # finished inside the timeout
        assert json.loads(short["events"][-2])["choices"][0]["finish_reason"] == "length"
        done = long["events"] and long["events"][-1] == "[DONE]"
        assert not done or "error" in long["events"][-2], "the long stream was not cut off"
        assert 3 <= took < 3 + 6, f"exit {took:.1f} s after SIGTERM (--shutdown-timeout 3)"
    finally:
        stop_server(srv)


def test_requests_cut_at_the_shutdown_deadline_get_a_json_503():
    """uvicorn cancels what is still running a second after the drain: a request without a
    response yet (generating, or still sending its body) gets an OpenAI-shaped 503, not a
    plain 500 and a traceback; a stream that started is left to be cut; a cancel outside a
    drain propagates."""
    from paged.server.app import Guard

    async def cut(stage: str, draining: bool = True) -> list[dict]:
        async def app(scope, receive, send):
            if stage == "stream":
                await send({"type": "http.response.start", "status": 200, "headers": []})
            await asyncio.sleep(3600)  # a long generation

        async def receive() -> dict:
            if stage == "body":
                await asyncio.sleep(3600)  # a slow upload
            return {"type": "http.request", "body": b"{}", "more_body": False}

        sent: list[dict] = []

        async def send(msg: dict) -> None:
            sent.append(msg)

        state = SimpleNamespace(api_key=None, max_body=1000, draining=False, inflight=0,
                                body_timeout=60, max_pending_body=100, pending_body=0)  # fmt: skip
        scope = {"type": "http", "path": "/v1/completions", "headers": []}
        task = asyncio.create_task(Guard(app, state)(scope, receive, send))
        await asyncio.sleep(0.05)
        state.draining = draining  # SIGTERM
        task.cancel(msg="Task cancelled, timeout graceful shutdown exceeded")  # as uvicorn
        await task
        assert state.inflight == 0
        return sent

    for stage in ("app", "body"):
        sent = asyncio.run(cut(stage))
        assert sent[0]["status"] == 503, stage
        err = json.loads(sent[1]["body"])["error"]
        assert err["type"] == "service_unavailable" and "shutting down" in err["message"]
    assert [m["type"] for m in asyncio.run(cut("stream"))] == ["http.response.start"]
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(cut("app", draining=False))


def _server(args: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "paged.server", "--port", "0", "--log-level", "warning"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **QUIET_OMP}
    return subprocess.Popen([*cmd, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)  # fmt: skip


def _model_copy(tiny_model: str, root: Path, name: str, **config) -> str:
    d = root / name
    shutil.copytree(tiny_model, d)
    cfg = json.loads((d / "config.json").read_text()) | config
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def test_server_startup_errors_exit_early(tiny_model, tmp_path):
    corrupt = _model_copy(tiny_model, tmp_path, "corrupt")
    data = Path(corrupt, "model.safetensors").read_bytes()
    Path(corrupt, "model.safetensors").write_bytes(data[: len(data) // 2])  # truncated
    cases = {  # args -> what the log must say
        (str(tmp_path / "nowhere"),): "not found",
        (corrupt,): "corrupt or truncated",
        (tiny_model, "--max-model-len", "256", "--num-kv-blocks", "1"): "too few",
    }
    t0 = time.monotonic()
    procs = {args: _server(list(args)) for args in cases}  # in parallel: a few seconds each
    for args, p in procs.items():
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 1, out[-2000:]
        assert cases[args] in out, out[-2000:]
        assert "Traceback" not in out.split("engine start-up failed")[-1][-300:]
    assert time.monotonic() - t0 < 90


@pytest.mark.parametrize(
    "kind, expect",
    [
        ("missing", "no *.safetensors"),
        ("garbage", "corrupt or truncated"),
        ("gpt2", "unsupported model architecture"),
        ("unknown", "frobnicator"),
        ("kv_memory", "too few"),
        ("kv_blocks", "too few"),
    ],
)
def test_engine_startup_errors(tiny_model, tmp_path, kind, expect):
    from paged.engine.core import EngineCore

    kw: dict[str, object] = {"max_model_len": 256, "dtype": "float32"}
    model = tiny_model
    if kind == "missing":
        model = _model_copy(tiny_model, tmp_path, "m")
        os.remove(Path(model, "model.safetensors"))
    elif kind == "garbage":
        model = _model_copy(tiny_model, tmp_path, "m")
        Path(model, "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    elif kind == "gpt2":
        model = _model_copy(tiny_model, tmp_path, "m", model_type="gpt2",
                            architectures=["GPT2LMHeadModel"])  # fmt: skip
    elif kind == "unknown":
        model = _model_copy(tiny_model, tmp_path, "m", model_type="frobnicator",
                            architectures=["FrobForCausalLM"])  # fmt: skip
    elif kind == "kv_memory":
        kw["kv_cache_memory"] = "1KiB"
    else:
        kw["num_kv_blocks"] = 15  # one short of 256 tokens
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=None) as info:
        EngineCore(EngineConfig(model=model, **kw))
    assert expect in str(info.value), info.value
    assert time.monotonic() - t0 < 30


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended


def test_engine_core_ends_with_a_killed_server(tiny_model, tmp_path):
    """kill -9 of the HTTP process (no handler runs) must not leave the core computing."""
    srv = start_server([tiny_model, *TINY_ARGS], tmp_path / "server.log",
                       {"PAGED_TEST_STEP_DELAY": "0.05"})  # fmt: skip
    core = srv.core_pid()
    try:
        body = {"prompt": [5, 6], "max_tokens": 200, "ignore_eos": True, "n": 8}
        threads = [
            threading.Thread(target=stream_events, args=(srv.url, body | {"stream": True}, {}))
            for _ in range(4)
        ]
        for t in threads:
            t.start()
        time.sleep(1.0)  # busy: 32 sequences, ~10 s of steps left
        srv.proc.kill()
        srv.proc.wait(5)
        deadline = time.monotonic() + 5
        while _alive(core) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(core), "the engine core outlived its server"
        for t in threads:
            t.join(10)
    finally:
        stop_server(srv)
        if _alive(core):
            os.kill(core, signal.SIGKILL)


@pytest.mark.slow  # 15 s, SIGTERM's drain again (tested above): with the long checks
def test_sighup_drains_like_sigterm(tiny_model, tmp_path):
    srv = start_server([tiny_model, *TINY_ARGS], tmp_path / "server.log")
    try:
        srv.proc.send_signal(signal.SIGHUP)
        assert srv.proc.wait(timeout=30) == 0  # drained and stopped, not killed by the signal
    finally:
        stop_server(srv)
