"""Server lifecycle on a tiny random model (fast start): engine death and SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    """A 2-layer random Llama that uses the default model's tokenizer (and chat template)."""
    from tiny_hf import llama_with_tokenizer

    from paged.model.loader import load_tokenizer, resolve_model

    path = str(tmp_path_factory.mktemp("tiny") / "tiny-llama")
    return llama_with_tokenizer(path, load_tokenizer(resolve_model(None)))


TINY_ARGS = ["--max-model-len", "256", "--kv-cache-memory", "16MiB"]


def test_engine_death_fails_requests_and_exits_nonzero(tiny_model, launch):
    srv = launch([tiny_model, *TINY_ARGS])
    body = {"prompt": "hello", "max_tokens": 240, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        os.kill(srv.core_pid(), signal.SIGKILL)
        events = [ln[6:] for ln in lines if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert "engine" in err["message"] and err["type"] == "service_unavailable"
    try:  # until it exits, the server says it is unhealthy
        assert httpx.get(srv.url + "/health", timeout=5).status_code == 503
    except httpx.TransportError:  # already gone: refused, or reset as it closed
        pass
    assert srv.proc.wait(timeout=30) == 1
    assert "engine dead" in srv.log.read_text()


@pytest.mark.slow  # 14 s; test_startup_shutdown drains a stream the same way: with the long checks
def test_sigterm_finishes_in_flight_then_exits_zero(tiny_model, launch):
    srv = launch([tiny_model, *TINY_ARGS])
    # 240 tokens: the stream outlasts the checks below (100 took ~0.2 s, and a loaded
    # machine once finished them, drained and exited before the first check)
    body = {"prompt": "hello", "max_tokens": 240, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        srv.proc.send_signal(signal.SIGTERM)
        for _ in range(100):  # until the signal is handled
            if httpx.get(srv.url + "/health", timeout=5).status_code == 503:
                break
            time.sleep(0.01)
        assert httpx.get(srv.url + "/health", timeout=5).status_code == 503
        late = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi"}, timeout=5)
        assert late.status_code == 503 and "shutting down" in late.json()["error"]["message"]
        events = [ln[6:] for ln in lines if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    assert srv.proc.wait(timeout=30) == 0
