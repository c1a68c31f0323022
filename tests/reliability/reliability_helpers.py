"""Helpers the reliability tests share (imported by name: pytest puts this folder on sys.path).

Server helpers (start_server, stop_server, Server) come from tests/server/conftest.py, loaded
by path (tests/server_helpers.py) so that the test folders need no package layout.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import httpx
from server_helpers import server_helpers
from tiny_hf import spread_weights

helpers = server_helpers()
Server, stop_server = helpers.Server, helpers.stop_server
# OpenMP threads that spin while waiting make every step 3-6x slower when another process
# competes for the 2 cores of a shared runner (a 500-client round: 84 s instead of 26 s).
QUIET_OMP = {"OMP_WAIT_POLICY": "PASSIVE"}


def start_server(args: list[str], log: Path, env: dict[str, str] | None = None) -> Server:
    """tests/server's start_server (waits for /health 200), with passive OpenMP waits."""
    return helpers.start_server(args, log, QUIET_OMP | (env or {}))


API_KEY = "reliability-key-42"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
TINY_ARGS = ["--max-model-len", "256", "--kv-cache-memory", "16MiB", "--dtype", "float32"]
_PATH = re.compile(r"(?:[A-Za-z]:)?(?:/[\w.-]+){2,}")  # /tmp/x, /usr/lib/python3/...
_POINTER = re.compile(r"#/[\w./~-]*")  # a JSON-schema $ref the client sent (#/definitions/x)


def check_error(r: httpx.Response, status: int | tuple[int, ...]) -> dict[str, Any]:
    """The response is an OpenAI-shaped error with one of `status`; returns its body."""
    want = (status,) if isinstance(status, int) else status
    assert r.status_code in want, (r.status_code, r.text[:500])
    e = r.json()["error"]
    assert set(e) >= {"message", "type", "param", "code"}, e
    assert isinstance(e["message"], str) and e["message"], e
    assert_no_leak(e["message"])
    return e


def assert_no_leak(text: str) -> None:
    """No filesystem paths or stack traces in what a client sees."""
    assert "Traceback" not in text and 'File "' not in text, text[:500]
    assert not _PATH.search(_POINTER.sub("#", text)), text[:500]


def make_tiny_model(path: Path) -> str:
    """A 2-layer random Llama with the default model's tokenizer (and chat template)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from paged.model.loader import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(None))
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tok),
                      max_position_embeddings=512, eos_token_id=tok.eos_token_id)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    spread_weights(model)
    model.save_pretrained(str(path), safe_serialization=True)
    tok.save_pretrained(str(path))
    return str(path)


def metric(text: str, name: str) -> float:
    """The value of a (single-series) Prometheus metric in /metrics text."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def wait_idle(http: httpx.Client, timeout: float = 10.0) -> str:
    """/metrics once nothing runs or waits and every KV block is free."""
    end = time.monotonic() + timeout
    while True:
        m = http.get("/metrics").text
        busy = metric(m, "paged:num_requests_running") + metric(m, "paged:num_requests_waiting")
        if busy == 0 and metric(m, "paged:kv_cache_usage_perc") == 0:
            return m
        assert time.monotonic() < end, "requests still running or KV blocks still held"
        time.sleep(0.05)
