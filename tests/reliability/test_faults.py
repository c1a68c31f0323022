"""Engine faults on a tiny model: a failing step, disconnects, KV pressure, requests that can
never fit. The fault comes from the test-only hook in paged/engine/faults.py."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest
from reliability_helpers import check_error, metric, start_server, stop_server, wait_idle

POISON = 12345  # a step whose batch has this token id in a prompt raises
SLOW = 23456  # a step whose batch has this one in a prompt sleeps 50 ms (holds it in flight)
# 8 blocks of 16 tokens: exactly one request of max_model_len 128
ARGS = ["--max-model-len", "128", "--num-kv-blocks", "8", "--dtype", "float32"]


@pytest.fixture(scope="module")
def srv(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("faults") / "server.log"
    env = {"PAGED_TEST_FAULT_TOKEN": str(POISON), "PAGED_TEST_SLOW_TOKEN": str(SLOW),
           "PAGED_TEST_STEP_DELAY": "0.05"}  # fmt: skip
    s = start_server([tiny_model, *ARGS], log, env)
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def http(srv):
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        yield c


def greedy(prompt: list[int], max_tokens: int, stream: bool = False) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}  # fmt: skip


def test_step_exception_fails_its_requests_not_the_server(http, srv):
    e = check_error(http.post("/v1/completions", json=greedy([POISON, 5, 6], 4)), 500)
    assert "engine" in e["message"] and e["type"] == "server_error", e
    assert "faults.py" not in e["message"] and "injected" not in e["message"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = http.post("/v1/chat/completions", json=chat | {"logit_bias": {POISON: 0}})
    assert r.status_code == 200, r.text  # the poison only counts in prompts
    # streamed: the step fails before the first token, so before the response head (the server
    # waits for the first update): the same 500 as without stream, not a 200 and an event
    err = check_error(http.post("/v1/completions", json=greedy([POISON], 4, stream=True)), 500)
    assert err["type"] == "server_error" and "engine" in err["message"], err
    assert set(err) == {"message", "type", "param", "code"}, err
    assert http.get("/health").status_code == 200
    r = http.post("/v1/completions", json=greedy([5, 6, 7], 3))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    wait_idle(http)
    assert "step failed" in srv.log.read_text()  # the details go to the log


ABORTED = 'paged:request_success_total{finished_reason="abort",'


def aborted_count(text: str) -> float:
    return next(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(ABORTED))


def test_disconnects_abort_and_free_blocks(http, srv):
    m0 = http.get("/metrics").text
    before = metric(m0, "paged:generation_tokens_total")
    aborted, e2e = aborted_count(m0), metric(m0, "paged:e2e_request_latency_seconds_count")
    with httpx.stream("POST", srv.url + "/v1/completions", json=greedy([SLOW, 8], 120, True)) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
    with pytest.raises(httpx.ReadTimeout):  # a non-streamed request whose client gives up
        httpx.post(srv.url + "/v1/completions", json=greedy([SLOW, 6], 120), timeout=0.5)
    m = wait_idle(http)
    # either request alone would have made 120 tokens (at 50 ms a step) without its abort
    assert metric(m, "paged:generation_tokens_total") - before < 120
    # both are counted as aborted, and their latency observed
    end = time.monotonic() + 5
    while aborted_count(m) - aborted < 2 and time.monotonic() < end:
        time.sleep(0.05)
        m = http.get("/metrics").text
    assert aborted_count(m) - aborted == 2
    assert metric(m, "paged:e2e_request_latency_seconds_count") - e2e == 2


def test_kv_pressure_preempts_and_every_request_completes(http):
    # SLOW holds every step of the first request's 36 at 50 ms, so all four overlap however
    # late their threads start: the first three alone need 9 blocks of the 8
    prompts = [[SLOW] + [100] * 11] + [[100 + i] * 12 for i in (1, 2)] + [[7] * 16]
    lens = [36, 36, 36, 112]  # 3 + 3 + 3 + 8 blocks of 16; the last one needs the whole pool
    ref = [http.post("/v1/completions", json=greedy(p, n)).json()["choices"][0]["text"]
           for p, n in zip(prompts, lens)]  # fmt: skip
    pre = metric(http.get("/metrics").text, "paged:num_preemptions_total")
    out: dict[int, httpx.Response] = {}

    def run(i: int) -> None:
        out[i] = httpx.post(http.base_url.join("/v1/completions"), json=greedy(prompts[i], lens[i]),
                            timeout=120)  # fmt: skip

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    for i, want in enumerate(ref):
        assert out[i].status_code == 200, out[i].text
        ch = out[i].json()["choices"][0]
        assert ch["text"] == want and ch["finish_reason"] == "length"
    m = wait_idle(http)
    assert metric(m, "paged:num_preemptions_total") > pre


def test_request_that_can_never_fit_is_refused(http):
    # prompt + max_tokens beyond max_model_len (= the whole pool here): 400 at admission
    e = check_error(http.post("/v1/completions", json=greedy([7] * 56, 73)), 400)
    assert e["param"] == "max_tokens" and e["code"] == "context_length_exceeded"
    assert "128" in e["message"] and "129" in e["message"]
    e = check_error(http.post("/v1/completions", json={"prompt": [7] * 128}), 400)
    assert e["param"] == "prompt" and e["code"] == "context_length_exceeded"
    r = http.post("/v1/completions", json=greedy([7] * 56, 72))  # exactly the pool: fits
    assert r.status_code == 200 and r.json()["usage"]["total_tokens"] == 128
    wait_idle(http)


def test_engine_death_health_503_inflight_errors_exit_1(srv):
    """Last in this file: it kills the module's server."""
    got: dict[str, httpx.Response] = {}
    url = srv.url + "/v1/completions"

    def full() -> None:  # a non-streamed request in flight
        got["r"] = httpx.post(url, json=greedy([SLOW, 6], 120), timeout=60)

    t = threading.Thread(target=full)
    t.start()
    with httpx.stream("POST", url, json=greedy([SLOW], 120, True)) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        end = time.monotonic() + 10  # both in the engine (each needs 6 s at 50 ms a step)
        while metric(httpx.get(srv.url + "/metrics").text, "paged:num_requests_running") < 2:
            assert time.monotonic() < end
            time.sleep(0.05)
        os.kill(srv.core_pid(), signal.SIGKILL)
        events = [ln[6:] for ln in lines if ln.startswith("data: ")]
    t.join(30)
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["type"] == "service_unavailable" and "engine" in err["message"]
    assert "code" in err and "restart" not in err["message"], err  # the server exits
    check_error(got["r"], 503)
    try:  # until it exits, the server says it is unhealthy and refuses work
        assert httpx.get(srv.url + "/health", timeout=5).status_code == 503
        check_error(httpx.post(url, json=greedy([5], 2), timeout=5), 503)
    except httpx.TransportError:
        pass  # already gone
    assert srv.proc.wait(timeout=30) == 1
    assert "engine dead" in srv.log.read_text()
