"""What one client can cost the server: idle and slow connections, huge prompts and chats,
deep JSON, a stalled engine. One server with short timeouts for the whole module."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import urlparse

import httpx
import pytest
from reliability_helpers import TINY_ARGS, check_error, start_server, stop_server

from paged.server.app import Guard
from paged.server.limits import timed_protocol

FLAGS = ["--idle-timeout", "2", "--body-timeout", "2", "--health-timeout", "2",
         "--max-prompt-chars", "3000000", "--max-request-body", "16MiB"]  # fmt: skip


@pytest.fixture(scope="module")
def srv(tiny_model, tmp_path_factory):
    s = start_server([tiny_model, *TINY_ARGS, *FLAGS],
                     tmp_path_factory.mktemp("resources") / "server.log")  # fmt: skip
    yield s
    stop_server(s)


def _connect(url: str) -> socket.socket:
    u = urlparse(url)
    return socket.create_connection((u.hostname, u.port), timeout=10)


def _closed_by_server(sock: socket.socket, within: float) -> bool:
    sock.settimeout(within)
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return True
            if b"408" in data.split(b"\r\n", 1)[0]:
                return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_silent_and_slow_connections_are_closed(srv):
    silent = [_connect(srv.url) for _ in range(50)]
    slow_head = _connect(srv.url)
    slow_head.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # never finished
    slow_body = _connect(srv.url)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    slow_body.sendall(head + b'Content-Length: 1000000\r\n\r\n{"prompt"')
    try:
        t0 = time.monotonic()
        assert all(_closed_by_server(s, 8) for s in silent)
        assert _closed_by_server(slow_head, 8)
        slow_body.settimeout(8)
        head = slow_body.recv(65536).split(b"\r\n", 1)[0]
        assert b"408" in head, head
        assert time.monotonic() - t0 < 10
    finally:
        for s in [*silent, slow_head, slow_body]:
            s.close()
    assert httpx.get(srv.url + "/health", timeout=5).status_code == 200


def test_timed_protocol_is_httptools_when_installed():
    from uvicorn.protocols.http.h11_impl import H11Protocol

    assert issubclass(timed_protocol(2, "h11"), H11Protocol)
    pytest.importorskip("httptools")
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    assert issubclass(timed_protocol(2), HttpToolsProtocol)


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_idle_timeout_of_each_protocol(http):
    """Silent, half-sent and finished-then-silent connections are closed after the idle
    timeout; one whose response is still being written is not."""
    if http == "httptools":
        pytest.importorskip("httptools")
    import uvicorn

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        if scope["path"] == "/slow":  # a stream that outlives the idle timeout
            for _ in range(6):
                await send({"type": "http.response.body", "body": b"x", "more_body": True})
                await asyncio.sleep(0.2)
        await send({"type": "http.response.body", "body": b"ok"})

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    config = uvicorn.Config(app, http=timed_protocol(0.5, http), loop="asyncio",
                            lifespan="off", log_level="warning")  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.01)
        silent, half, done, busy = (_connect(url) for _ in range(4))
        half.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
        done.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        busy.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        t0 = time.monotonic()
        assert _closed_by_server(silent, 3) and _closed_by_server(half, 3)
        assert _closed_by_server(done, 3)  # its response, then the close
        assert time.monotonic() - t0 < 2.5
        busy.settimeout(3)
        got = b""
        while not got.endswith(b"0\r\n\r\n"):  # the whole chunked body, not cut at 0.5 s
            data = busy.recv(65536)
            assert data, got
            got += data
        assert b"ok" in got
        for s in (silent, half, done, busy):
            s.close()
    finally:
        server.should_exit = True
        thread.join(10)


def test_open_file_limit_raised(srv):
    limits = Path(f"/proc/{srv.proc.pid}/limits").read_text()
    line = next(ln for ln in limits.splitlines() if ln.startswith("Max open files"))
    soft, hard = line.split()[3:5]
    want = 65535 if hard == "unlimited" else min(65535, int(hard))
    assert int(soft) >= want, line


def test_pending_bodies_are_capped():
    """Uploads under way together may not hold more than max_pending_body bytes."""

    async def app(scope, receive, send):
        raise AssertionError("not reached")

    state = SimpleNamespace(api_key=None, max_body=1000, draining=False, inflight=0,
                            body_timeout=5.0, max_pending_body=100, pending_body=0)  # fmt: skip
    guard = Guard(app, state)
    scope = {"type": "http", "path": "/v1/completions", "headers": []}

    async def run() -> list[int]:
        stall = asyncio.Event()

        async def slow() -> dict:  # 80 bytes, then nothing
            if not stall.is_set():
                stall.set()
                return {"type": "http.request", "body": b"x" * 80, "more_body": True}
            await asyncio.sleep(3600)

        async def second() -> dict:
            return {"type": "http.request", "body": b"y" * 50, "more_body": False}

        sent: list[int] = []

        async def record(msg: dict) -> None:
            if msg["type"] == "http.response.start":
                sent.append(msg["status"])

        first = asyncio.create_task(guard(scope, slow, lambda m: asyncio.sleep(0)))
        await stall.wait()
        await guard(scope, second, record)
        first.cancel()
        return sent

    assert asyncio.run(run()) == [503]


def test_huge_prompt_never_freezes_the_server(srv):
    """2 MB of text is tokenized off the event loop: /health answers meanwhile."""
    text = "hello world, this is a test of the tokenizer. " * 44000  # ~2 MB
    got: dict[str, httpx.Response] = {}

    def post() -> None:
        got["r"] = httpx.post(srv.url + "/v1/completions", json={"prompt": text}, timeout=60)

    t = threading.Thread(target=post)
    t.start()
    worst = 0.0
    while t.is_alive():
        t0 = time.monotonic()
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
        worst = max(worst, time.monotonic() - t0)
        time.sleep(0.02)
    t.join()
    e = check_error(got["r"], 400)
    assert e["code"] == "context_length_exceeded", e
    assert worst < 1.0, f"/health took {worst:.2f} s while a prompt was tokenized"


def test_work_one_request_may_cost_is_bounded(srv):
    t0 = time.monotonic()
    e = check_error(httpx.post(srv.url + "/v1/completions", json={"prompt": "a" * 3_100_000},
                               timeout=30), 400)  # fmt: skip
    assert e["param"] == "prompt" and "--max-prompt-chars" in e["message"], e
    chat = {"messages": [{"role": "user", "content": "hi"}] * 100_000}
    e = check_error(httpx.post(srv.url + "/v1/chat/completions", json=chat, timeout=30), 400)
    assert e["param"] == "messages" and "100000 messages" in e["message"], e
    assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("depth", [200, 963, 964, 5000])
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_deep_json_is_a_400(srv, route, depth):
    deep = '{"a":' * depth + "1" + "}" * depth
    if route == "/v1/completions":
        body = '{"prompt":"x","max_tokens":1,"junk":' + deep + "}"
    else:
        body = '{"max_tokens":1,"messages":[{"role":"user","content":"x","junk":' + deep + "}]}"
    r = httpx.post(srv.url + route, content=body, timeout=30,
                   headers={"content-type": "application/json"})  # fmt: skip
    e = check_error(r, 400)
    assert e["param"] == "body" and "nested deeper" in e["message"], e


def test_health_fails_while_the_engine_is_stalled(srv):
    core = srv.core_pid()
    os.kill(core, signal.SIGSTOP)
    try:
        end = time.monotonic() + 6
        while httpx.get(srv.url + "/health", timeout=5).status_code == 200:
            assert time.monotonic() < end, "/health stayed 200 with the engine stopped"
            time.sleep(0.1)
        r = httpx.get(srv.url + "/health", timeout=5)
        assert "not answered" in r.json()["error"]["message"]
    finally:
        os.kill(core, signal.SIGCONT)
    end = time.monotonic() + 6
    while httpx.get(srv.url + "/health", timeout=5).status_code != 200:
        assert time.monotonic() < end, "/health did not recover"
        time.sleep(0.1)
