"""A live `python -m paged.server` on the default model, started once per session."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

API_KEY = "test-key-123"
ENGINE_ARGS = ["--max-model-len", "2048", "--kv-cache-memory", "256MiB", "--dtype", "float32"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str  # http://127.0.0.1:PORT
    proc: subprocess.Popen
    log: Path

    def core_pid(self) -> int:
        """The engine core process: the server's child running the spawn bootstrap."""
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
                cmd = (stat.parent / "cmdline").read_bytes()
            except OSError:
                continue
            if int(fields[1]) == self.proc.pid and b"spawn_main" in cmd:
                return int(stat.parent.name)
        raise AssertionError("no engine core process found")


def start_server(args: list[str], log: Path, env: dict[str, str] | None = None) -> Server:
    port = free_port()
    # Test-only engine faults (PAGED_TEST_*) need the test launcher; real servers never read them.
    faulty = any(k.startswith("PAGED_TEST_") for k in (env or {}))
    entry = (
        [str(Path(__file__).parent.parent / "fault_server.py")]
        if faulty
        else ["-m", "paged.server"]
    )
    cmd = [sys.executable, *entry, "--port", str(port), "--log-level", "warning"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    with open(log, "w") as f:
        proc = subprocess.Popen([*cmd, *args], stdout=f, stderr=subprocess.STDOUT, env=env)
    srv = Server(f"http://127.0.0.1:{port}", proc, log)
    deadline = time.monotonic() + 240
    while True:
        if proc.poll() is not None:
            pytest.fail(f"the server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(srv.url + "/health", timeout=2).status_code == 200:
                return srv
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            stop_server(srv)
            pytest.fail(f"the server was not ready in 240 s:\n{log.read_text()[-3000:]}")
        time.sleep(0.25)


def stop_server(srv: Server) -> int:
    if srv.proc.poll() is None:
        srv.proc.send_signal(signal.SIGTERM)
        try:
            srv.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            srv.proc.kill()
            srv.proc.wait()
    return srv.proc.returncode


@pytest.fixture
def launch(tmp_path):
    """Start extra servers for one test (stopped afterwards): launch(args, env) -> Server."""
    started: list[Server] = []

    def start(args: list[str], env: dict[str, str] | None = None) -> Server:
        started.append(start_server(args, tmp_path / f"server{len(started)}.log", env))
        return started[-1]

    yield start
    for srv in started:
        stop_server(srv)
