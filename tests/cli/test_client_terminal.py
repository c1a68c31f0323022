"""paged chat / complete as people use them: at a terminal (line editing, history, Ctrl-C),
with piped input, and the errors they see (empty --quick, a refused API key, a URL without
/v1). Against a fake OpenAI-compatible server in a thread: it streams at a set pace, records
each request, and sees a client go away."""

from __future__ import annotations

import io
import json
import os
import pty
import select
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

KEY = "right-key"  # asked for under /keyed/v1; /v1 is open


class FakeHandler(BaseHTTPRequestHandler):
    """GET /v1/models; POST /v1/chat/completions and /v1/completions, streamed: 'ok' in two
    chunks, or for the text 'slow' a chunk every 20 ms until the client goes away."""

    server: FakeServer

    def log_message(self, *args) -> None:
        pass

    def _json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _route(self) -> str | None:
        """The path under /v1, or None once refused (401 as paged's, 404)."""
        path = self.path
        if path.startswith("/keyed/v1/"):
            if self.headers.get("Authorization") != f"Bearer {KEY}":
                msg = "invalid or missing API key (send 'Authorization: Bearer <key>' or ...)"
                err = {"message": msg, "type": "authentication_error", "code": "invalid_api_key"}
                self._json(401, {"error": {**err, "param": None}})
                return None
            return path[len("/keyed/v1") :]
        if path.startswith("/v1/"):
            return path[len("/v1") :]
        self._json(404, {"error": {"message": "Not Found", "type": "not_found_error"}})
        return None

    def do_GET(self) -> None:
        if self._route() == "/models":
            model = {"id": "fake", "object": "model", "created": 0, "owned_by": "test"}
            self._json(200, {"object": "list", "data": [model]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        route = self._route()
        if route not in ("/chat/completions", "/completions"):
            return
        self.server.requests.append(body)
        chat = route == "/chat/completions"
        text = body["messages"][-1]["content"] if chat else body["prompt"]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()  # HTTP/1.0: the stream ends when the connection closes

        def event(piece: str) -> None:
            choice = {"index": 0, "finish_reason": None}
            choice |= {"delta": {"content": piece}} if chat else {"text": piece}
            chunk = {"id": "x", "object": "chunk", "created": 0, "model": "fake"}
            self.wfile.write(f"data: {json.dumps(chunk | {'choices': [choice]})}\n\n".encode())
            self.wfile.flush()

        try:
            if text == "slow":
                for _ in range(1000):  # 20 s at most
                    event("tick ")
                    time.sleep(0.02)
            else:
                event("o")
                event("k")
                self.wfile.write(b"data: [DONE]\n\n")
        except (BrokenPipeError, ConnectionResetError):
            self.server.aborted.set()


class FakeServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), FakeHandler)
        self.requests: list[dict] = []
        self.aborted = threading.Event()


@pytest.fixture(scope="module")
def fake():
    server = FakeServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    server.root = f"http://127.0.0.1:{server.server_address[1]}"
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def fresh(fake):
    fake.requests.clear()
    fake.aborted.clear()
    return fake


# --- at a terminal: a pty ---


class Terminal:
    """`paged ARGS` with a pty for stdin, stdout and stderr."""

    def __init__(self, exe: list[str], *args: str) -> None:
        master, slave = pty.openpty()
        env = {**os.environ, "TERM": "xterm", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        env.pop("PAGED_API_KEY", None)
        env.pop("OPENAI_API_KEY", None)
        # Ctrl-C's default action, whatever this process has: a shell's background job (as
        # CI may run the suite) starts with SIGINT ignored, and children inherit that.
        self.proc = subprocess.Popen(
            [*exe, *args], stdin=slave, stdout=slave, stderr=slave, env=env,
            start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )  # fmt: skip
        os.close(slave)
        self.fd, self.out = master, ""

    def read_until(self, needle: str, start: int = 0, timeout: float = 30) -> int:
        """Read until `needle` is in the output past `start`; where it ends."""
        deadline = time.monotonic() + timeout
        while (at := self.out.find(needle, start)) < 0:
            left = deadline - time.monotonic()
            assert left > 0, f"no {needle!r} in {self.out[start:]!r}"
            if select.select([self.fd], [], [], left)[0]:
                try:
                    data = os.read(self.fd, 4096)
                except OSError:  # EIO: the child closed the terminal
                    data = b""
                assert data, f"exited before {needle!r}: {self.out!r}"
                self.out += data.decode(errors="replace")
        return at + len(needle)

    def type(self, keys: str) -> None:
        os.write(self.fd, keys.encode())

    def wait(self) -> int:
        try:
            return self.proc.wait(timeout=30)
        finally:
            while select.select([self.fd], [], [], 0)[0]:  # the last output
                try:
                    data = os.read(self.fd, 4096)
                except OSError:
                    break
                if not data:
                    break
                self.out += data.decode(errors="replace")
            os.close(self.fd)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def terminal(paged_exe):
    opened: list[Terminal] = []

    def open_(*args: str) -> Terminal:
        opened.append(Terminal(paged_exe, *args))
        return opened[-1]

    yield open_
    for t in opened:
        t.kill()


def test_chat_at_a_terminal_edits_lines_and_survives_ctrl_c(terminal, fresh):
    """Arrow keys edit the line and recall history (readline); Ctrl-C during a reply stops it
    (the server sees the client go), drops that turn and gives the prompt back; Ctrl-D ends
    the session with 0."""
    t = terminal("chat", "--url", fresh.root + "/v1")
    at = t.read_until("> ")
    t.type("hellp\x1b[D\x7f\r")  # left arrow, backspace: "help"
    at = t.read_until("> ", t.read_until("ok", at))
    t.type("\x1b[A\r")  # up arrow: "help" again
    at = t.read_until("> ", t.read_until("ok", at))
    assert [m["content"] for m in fresh.requests[1]["messages"]] == ["help", "ok", "help"]
    t.type("slow\r")
    at = t.read_until("tick tick ", at)
    os.kill(t.proc.pid, signal.SIGINT)  # what the terminal sends for Ctrl-C
    at = t.read_until("\n", at)  # the cut reply's line ended, ...
    at = t.read_until("> ", at)  # ... and the prompt is back
    assert fresh.aborted.wait(10), "the stream was not closed"
    t.type("again\r")
    at = t.read_until("> ", t.read_until("ok", at))
    # the interrupted turn left the history
    assert [m["content"] for m in fresh.requests[-1]["messages"]] == [
        "help", "ok", "help", "ok", "again",
    ]  # fmt: skip
    t.type("\x04")  # Ctrl-D
    assert t.wait() == 0
    assert "Traceback" not in t.out


def test_ctrl_c_at_the_prompt_ends_the_session(terminal, fresh):
    t = terminal("complete", "--url", fresh.root + "/v1")
    t.read_until("> ")
    # A SIGINT between readline's printing the prompt and its waiting for a key is seen only
    # at the next key (CPython's readline loop): on a loaded host, press Ctrl-C again.
    for _ in range(5):
        time.sleep(0.2)
        os.kill(t.proc.pid, signal.SIGINT)
        try:
            t.proc.wait(timeout=3)
            break
        except subprocess.TimeoutExpired:
            pass
    assert t.wait() == 130
    assert "Traceback" not in t.out and t.out.endswith("\n")


# --- piped input: no prompts in stdout ---


def test_piped_chat_prints_only_the_answers(cli, fresh, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n\n   \nhi again\n"))
    rc, out, err = cli("chat", "--url", fresh.root + "/v1")
    assert rc == 0, err
    assert out == "ok\nok\n"  # blank lines skipped, no "> "
    assert "> " not in err and "chatting with fake" in err
    assert [m["content"] for m in fresh.requests[-1]["messages"]] == ["hello", "ok", "hi again"]


def test_piped_complete_prints_only_the_completions(cli, fresh, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("the quick\nbrown\n"))
    rc, out, err = cli("complete", "--url", fresh.root + "/v1")
    assert rc == 0, err
    assert out == "ok\nok\n"  # as --quick: the completion, not the prompt again
    assert [r["prompt"] for r in fresh.requests] == ["the quick", "brown"]


# --- refusals and errors: one line on stderr ---


@pytest.mark.parametrize("cmd, text", [("chat", ""), ("chat", "  \n"), ("complete", "")])
def test_empty_quick_is_refused(cli, cmd, text):
    rc, out, err = cli(cmd, "--url", "http://127.0.0.1:9/v1", "--quick", text)
    assert rc == 2 and out == ""
    assert err.startswith("error: --quick: the text is empty") and err.count("\n") == 1


@pytest.mark.parametrize("extra", [[], ["--model", "fake"]])  # refused at /models, or on send
def test_wrong_api_key(cli, fresh, monkeypatch, extra):
    monkeypatch.delenv("PAGED_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    url = fresh.root + "/keyed/v1"
    rc, out, err = cli("chat", "--url", url, "--api-key", "wrong", "--quick", "hi", *extra)
    assert rc == 1 and out == ""
    assert err.startswith(f"error: {url} refused the API key: invalid or missing API key")
    assert "cannot reach" not in err and err.count("\n") == 1
    rc, _, err = cli("complete", "--url", url, "--quick", "hi", *extra)
    assert rc == 1 and err.startswith(f"error: {url} needs an API key: give it with --api-key")
    rc, out, err = cli("chat", "--url", url, "--api-key", KEY, "--quick", "hi", *extra)
    assert rc == 0 and out == "ok\n", err


def test_url_without_v1_gets_a_hint(cli, fresh):
    rc, _, err = cli("chat", "--url", fresh.root, "--quick", "hi")
    assert rc == 1 and err.count("\n") == 1
    assert f"{fresh.root} answered 404 (Not Found): is the URL missing /v1?" in err


def test_bench_serve_errors_are_one_line(cli, fresh):
    url = fresh.root + "/keyed/v1"
    flags = ["--num-prompts", "1", "--disable-tqdm", "--vocab-size", "9"]
    rc, out, err = cli("bench", "serve", "--url", url, "--api-key", "wrong", *flags)
    assert rc == 1 and err.count("\n") == 1, err
    assert err.startswith(f"error: {url}/models answered 401 Unauthorized: invalid or missing")
    assert "mozilla" not in err and "HTTPStatusError" not in err
    rc, out, err = cli("bench", "serve", "--url", url, "--model", "fake", *flags)
    assert rc == 1 and err.count("\n") == 1, err
    assert err.startswith(f"error: the test request to {url}/completions failed: HTTP 401 ")
    rc, _, err = cli("bench", "serve", "--url", fresh.root, *flags)
    assert rc == 1 and "answered 404 Not Found: Not Found (is --url missing /v1?)" in err
