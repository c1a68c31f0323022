"""Property-based runs (hypothesis) of generated requests against the tiny-model server:
2,000 to the OpenAI routes (request_strategies), 800 with structured outputs, tools, beam
search and to the Anthropic, Responses, embeddings and LoRA routes (route_strategies; with the
long checks, `make test-slow`). Bodies
are mostly plausible, with wrong types, out-of-range numbers, invalid schemas, regexes and
grammars, odd Unicode and random JSON mixed in. No 5xx, no server error inside a stream or in
the server's log, and the engine still serves."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from reliability_helpers import assert_no_leak, check_error, wait_idle
from request_strategies import REQUESTS
from route_strategies import ROUTE_REQUESTS

EXAMPLES = 2000  # make test sends 500 of them (7 s); the long checks all
ROUTE_EXAMPLES = 800
SERVER_FAULTS = ("unexpected error while generating", "engine step failed", "Traceback")


def check(r: httpx.Response) -> None:
    assert r.status_code < 500, r.text[:500]
    if r.status_code != 200:
        check_error(r, r.status_code)
    elif r.headers["content-type"].startswith("text/event-stream"):
        events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
        assert events and events[-1] == "[DONE]", r.text[-300:]
        for ev in events[:-1]:  # an error inside a 200 stream must be the client's fault
            err = json.loads(ev).get("error")
            assert err is None or err["type"] == "invalid_request_error", ev


@pytest.mark.parametrize("examples", [500, pytest.param(EXAMPLES, marks=pytest.mark.slow)])
def test_generated_requests_never_5xx(tiny_http, examples):
    sent = [0]

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,  # the same requests on every run
        suppress_health_check=list(HealthCheck),
    )
    @given(REQUESTS)
    def run(req: tuple[str, object]) -> None:
        route, body = req
        data = json.dumps(body).encode()  # NaN/Infinity and lone surrogates go out as sent
        sent[0] += 1
        check(tiny_http.post(route, content=data, headers={"content-type": "application/json"}))

    run()
    assert sent[0] >= examples
    assert tiny_http.get("/health").status_code == 200
    r = tiny_http.post(
        "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "ignore_eos": True}
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def check_route(route: str, r: httpx.Response) -> None:
    """check, with Anthropic's error shape and events on /v1/messages."""
    if not route.startswith("/v1/messages"):
        return check(r)
    assert r.status_code < 500, r.text[:500]
    if r.status_code != 200:
        body = r.json()
        assert body["type"] == "error" and body["error"]["message"], body
        assert_no_leak(body["error"]["message"])
    elif r.headers["content-type"].startswith("text/event-stream"):
        for ln in r.text.splitlines():
            ev = json.loads(ln[6:]) if ln.startswith("data: ") else {}
            assert ev.get("type") != "error" or ev["error"]["type"] == "invalid_request_error", ev


@pytest.mark.slow  # 800 requests, ~25 s on two cores: with the long checks (CI runs them)
def test_generated_requests_to_every_route_never_5xx(tiny_http, tiny_server):
    def faults() -> int:
        text = tiny_server.log.read_text(errors="replace")
        return sum(text.count(f) for f in SERVER_FAULTS)

    before, sent = faults(), [0]

    @settings(
        max_examples=ROUTE_EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(ROUTE_REQUESTS)
    def run(req: tuple[str, object]) -> None:
        route, body = req
        data = json.dumps(body).encode()
        sent[0] += 1
        r = tiny_http.post(route, content=data, headers={"content-type": "application/json"})
        check_route(route, r)

    run()
    assert sent[0] >= ROUTE_EXAMPLES
    assert faults() == before, "the server logged an internal error"
    assert tiny_http.get("/health").status_code == 200
    wait_idle(tiny_http)  # every request ended and freed its KV blocks
