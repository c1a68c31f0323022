"""A fleet keeps serving when a replica dies or goes silent (paged.engine.replicas).

One server for the module: two `cpu` replicas on a tiny random model, round-robin, with the
test launcher's step delay on prompts holding SLOW (each such step sleeps 2 s before it runs,
so requests are held before their first token). A replica killed while a batch waits for its
first step leaves the rotation, its requests are served by the other replica, and it comes
back (restarts 1, `paged:replica_restarts_total`); a stopped (silent) replica is killed after
--health-timeout and restarted while /health stays 200; SIGTERM drains the fleet.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
import rel
from prometheus_client.parser import text_string_to_metric_families

SLOW = 40000  # a token id no text prompt here holds: steps with it in a prompt sleep
FLEET = {"args": {"dtype": "float32", "max_model_len": 256, "kv_cache_memory": "8MiB"},
         "replicas": [{"platform": "cpu", "count": 2}]}  # fmt: skip


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> rel.Server:
    tmp = tmp_path_factory.mktemp("fleet-restart")
    model = rel.make_tiny_model(tmp / "tiny-llama")
    path = tmp / "fleet.json"
    path.write_text(json.dumps({"model": model, **FLEET}))
    env = {"PAGED_TEST_STEP_DELAY": "2", "PAGED_TEST_SLOW_TOKEN": str(SLOW)}
    args = ["--fleet", str(path), "--router", "round-robin", "--health-timeout", "3"]
    srv = rel.start_server(args, tmp / "server.log", env)
    yield srv
    rel.stop_server(srv)


def view(srv: rel.Server) -> dict:
    r = httpx.get(srv.url + "/fleet", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def wait_for(cond, what: str, timeout: float = 180.0):
    end = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)


def stream(srv: rel.Server, prompt, max_tokens: int, out: dict) -> None:
    """A streaming completion; out: events (data lines) and whether text came before an
    error event."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}  # fmt: skip
    out["events"], out["text_before_error"] = [], False
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=120) as r:
        out["status"] = r.status_code
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            out["events"].append(line[6:])
            if line[6:] != "[DONE]":
                ev = json.loads(line[6:])
                if "error" in ev:
                    out["error"] = ev["error"]
                elif ev["choices"] and ev["choices"][0]["text"]:
                    out["text_before_error"] = True


def complete(srv: rel.Server, prompt: str) -> dict:
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def restarts_metric(srv: rel.Server) -> dict[str, float]:
    out = {}
    for fam in text_string_to_metric_families(httpx.get(srv.url + "/metrics").text):
        for s in fam.samples:
            if s.name == "paged:replica_restarts_total":
                assert s.labels["platform"] == "cpu"
                out[s.labels["replica"]] = s.value
    return out


def finished(srv: rel.Server) -> dict[str, float]:
    """paged:request_success_total by finish reason."""
    out = {}
    for fam in text_string_to_metric_families(httpx.get(srv.url + "/metrics").text):
        for s in fam.samples:
            if s.name == "paged:request_success_total":
                out[s.labels["finished_reason"]] = s.value
    return out


def test_a_killed_replica_is_restarted_and_its_waiting_requests_served_elsewhere(fleet):
    rows = view(fleet)["replicas"]
    assert [(r["health"], r["restarts"]) for r in rows] == [("ready", 0)] * 2
    assert restarts_metric(fleet) == {"0": 0.0, "1": 0.0}
    victim = rows[0]
    counts = finished(fleet)
    prompts = [[SLOW, 100 + i, 200 + i, 300 + i] for i in range(6)]
    outs = [{} for _ in prompts]
    threads = [
        threading.Thread(target=stream, args=(fleet, p, 3, o)) for p, o in zip(prompts, outs)
    ]
    for t in threads:
        t.start()

    # Requests reach the victim (round-robin: three of the six) and wait for its first
    # step, which sleeps 2 s: its outstanding tokens are whole requests' (4 prompt + 3 to
    # generate each) until an output comes back, so a multiple of 7 means none has a token.
    def waiting() -> bool:
        left = view(fleet)["replicas"][0]["outstanding_tokens"]
        return left > 0 and left % 7 == 0

    wait_for(waiting, "requests waiting on the replica", 30)
    os.kill(victim["pid"], signal.SIGKILL)
    wait_for(lambda: view(fleet)["replicas"][0]["health"] == "restarting", "a restart", 30)
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a request hung after its replica died"
    failed = [o for o in outs if "error" in o and not o["text_before_error"]]
    assert not failed, failed  # none that had produced nothing failed
    assert all(o["status"] == 200 and o["events"][-1] == "[DONE]" for o in outs)
    assert view(fleet)["retried_requests"] >= 1  # the killed replica's ones, on the other
    now = finished(fleet)  # a retried request counts once, as it ended
    assert now["length"] == counts["length"] + 6 and now["error"] == counts["error"], now

    def back() -> bool:
        row = view(fleet)["replicas"][0]
        return row["health"] == "ready" and row["restarts"] == 1

    wait_for(back, "the replica to come back")
    rows = view(fleet)["replicas"]
    assert rows[0]["pid"] != victim["pid"] and rows[1]["restarts"] == 0
    assert restarts_metric(fleet) == {"0": 1.0, "1": 0.0}
    assert httpx.get(fleet.url + "/health").status_code == 200
    before = [r["prompt_tokens"] for r in rows]
    for p in ("Hello, my name is", "The capital of France is"):  # one each, in turns
        assert complete(fleet, p)["choices"][0]["text"]
    after = [r["prompt_tokens"] for r in view(fleet)["replicas"]]
    assert after[0] > before[0] and after[1] > before[1], (before, after)
    # nothing left behind: no work outstanding, every KV block free
    wait_for(lambda: all(r["outstanding_tokens"] == 0 and r["running"] == 0
                         and r["kv_cache_usage_perc"] == 0 for r in view(fleet)["replicas"]),
             "the replicas to be idle", 30)  # fmt: skip


def test_a_silent_replica_is_killed_and_restarted_while_the_other_serves(fleet):
    before = restarts_metric(fleet)  # whatever the tests before did to replica 0
    row = view(fleet)["replicas"][1]
    os.kill(row["pid"], signal.SIGSTOP)  # alive but silent: no outputs, no heartbeats
    try:
        # round-robin: the first goes to the stopped replica before it is found silent; it
        # had produced nothing, so it is served by the other once the stopped one is killed
        for p in ("Once upon a time", "1 2 3 4 5"):
            assert complete(fleet, p)["choices"][0]["text"]

        def restarting() -> bool:
            return view(fleet)["replicas"][1]["health"] in ("restarting", "ready")

        wait_for(restarting, "the silent replica to leave the rotation", 30)
        assert httpx.get(fleet.url + "/health").status_code == 200  # the other serves
    finally:
        try:
            os.kill(row["pid"], signal.SIGCONT)
        except ProcessLookupError:
            pass

    def back() -> bool:
        r = view(fleet)["replicas"][1]
        return r["restarts"] == 1 and r["health"] == "ready"

    wait_for(back, "the replica to come back")
    rows = view(fleet)["replicas"]
    assert rows[1]["pid"] != row["pid"] and "silent" in fleet.log.read_text()
    assert restarts_metric(fleet) == {"0": before["0"], "1": before["1"] + 1}


def test_sigterm_drains_the_fleet_then_stops_its_replicas(fleet):
    pids = [r["pid"] for r in view(fleet)["replicas"]]
    out: dict = {}
    t = threading.Thread(target=stream, args=(fleet, [SLOW, 7, 8, 9], 2, out))
    t.start()
    wait_for(lambda: sum(r["outstanding_tokens"] for r in view(fleet)["replicas"]) > 0,
             "the request to reach a replica", 30)  # fmt: skip
    fleet.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: httpx.get(fleet.url + "/health").status_code == 503, "draining", 10)
    r = httpx.post(fleet.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert r.status_code == 503  # no admission while draining
    t.join(60)
    assert "error" not in out and out["events"][-1] == "[DONE]", out  # in-flight work finished
    assert json.loads(out["events"][-2])["choices"][0]["finish_reason"] == "length"
    assert fleet.proc.wait(timeout=60) == 0
    for pid in pids:  # the replicas stopped with it
        wait_for(lambda pid=pid: not Path(f"/proc/{pid}").exists(), f"pid {pid} to end", 10)
