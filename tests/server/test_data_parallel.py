"""--data-parallel-size 2: two engine replicas behind one server (paged.engine.replicas).

One server on a tiny random model for the module: requests spread over both replicas and
go to the least loaded one, greedy outputs equal a single engine's, streams work, and a
replica that dies mid-stream ends its streams with an error and is restarted. Unit tests of
the router first.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import rel
from prometheus_client.parser import text_string_to_metric_families

from paged.config import EngineConfig
from paged.engine.placement import placements
from paged.engine.replicas import Replica, ReplicaSet, make_engine

ARGS = ["--max-model-len", "512", "--kv-cache-memory", "16MiB", "--dtype", "float32"]
PROMPTS = ["Hello, my name is", "The capital of France is", "1 2 3 4 5", "Once upon a time"]


# ---- the router, without processes --------------------------------------------------------
class FakeEngine:
    def __init__(self, platform: str = "cpu", blocks: int = 100) -> None:
        self.outstanding_tokens = 0
        self.ready, self.dead, self.on_dead, self.observer = True, None, None, None
        self.tokenizer = object()
        self.info = dict(max_model_len=512, num_blocks=blocks, pid=1, platform=platform)
        self.stats = {"num_requests_running": 1, "kv_cache_usage_perc": 0.5, "num_blocks": blocks}
        self.sent: list[str] = []
        self.aborted: list[str] = []

    def generate(self, request_id, prompt_ids, params, lora_request=None, user=None):
        self.sent.append(request_id)
        self.outstanding_tokens += len(prompt_ids)
        return iter(())

    def abort(self, request_id):
        self.aborted.append(request_id)

    def silent_for(self):
        return 0.5

    def fail(self, reason):
        if self.dead is None:
            self.dead, self.ready = reason, False
            if self.on_dead:
                self.on_dead()

    async def wait_ready(self):
        return self.ready


def fake_set(*engines: FakeEngine) -> ReplicaSet:
    return ReplicaSet([Replica(i, e) for i, e in enumerate(engines)])


def test_router_least_outstanding_work_and_turns_on_ties():
    a, b = FakeEngine(), FakeEngine()
    rs = fake_set(a, b)
    rs.generate("r1", [1] * 10, None)
    rs.generate("r2", [1] * 3, None)  # a holds 10, b nothing: b
    rs.generate("r3", [1] * 3, None)  # b holds 3: b again
    assert (a.sent, b.sent) == (["r1"], ["r2", "r3"])
    a.outstanding_tokens = b.outstanding_tokens = 0
    for i in range(4):  # idle replicas take turns
        rs.generate(f"t{i}", [1], None)
        a.outstanding_tokens = b.outstanding_tokens = 0
    assert len(a.sent) == 3 and len(b.sent) == 4
    rs.abort("r2")
    assert a.aborted == b.aborted == ["r2"]


def test_set_sums_stats_merges_info_and_fails_as_one():
    a, b = FakeEngine(blocks=100), FakeEngine(blocks=300)
    b.stats = {"num_requests_running": 2, "kv_cache_usage_perc": 0.0, "num_blocks": 300}
    b.info = dict(b.info, max_model_len=256)
    rs = fake_set(a, b)
    fired = []
    rs.on_dead = lambda: fired.append(1)
    assert rs.stats == {"num_requests_running": 3, "kv_cache_usage_perc": 0.125, "num_blocks": 400}
    assert rs.info["max_model_len"] == 256 and rs.info["num_blocks"] == 400
    assert rs.info["data_parallel_size"] == 2 and rs.tokenizer is a.tokenizer
    assert rs.ready and rs.silent_for() == 0.5
    b.fail("the engine core process exited (code -9)")
    assert rs.dead == "replica 1: the engine core process exited (code -9)"
    assert a.dead == rs.dead and not rs.ready and fired == [1]  # the healthy one fails too


def test_replicas_on_different_platforms_are_refused():
    rs = fake_set(FakeEngine("cuda"), FakeEngine("cpu"))
    assert asyncio.run(rs.wait_ready()) is False
    assert "different platforms (cuda, cpu)" in rs.dead


CUDA = EngineConfig(platform="cuda")


def test_placements_split_cores_and_devices(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4}, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    ps = placements(CUDA, 2)
    assert [p.cpus for p in ps] == [(0, 1), (2, 3, 4)] and [p.threads for p in ps] == [2, 3]
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in ps] == ["4", "5"]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert [p.threads for p in placements(CUDA, 2)] == [1, 1]
    ps = placements(CUDA, 8)  # more replicas than cores: not pinned, one thread
    assert all(p.cpus is None and p.threads == 1 for p in ps)
    assert ps[3].env["CUDA_VISIBLE_DEVICES"] == ""  # no device left for it
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    ps = placements(CUDA, 20_000)  # linear in the count (was quadratic: a hang)
    assert ps[-1].env["CUDA_VISIBLE_DEVICES"] == "19999" and ps[-1].cpus is None
    assert ps[1].describe() == "replica 1: cores any, 1 threads; CUDA_VISIBLE_DEVICES=1"
    # the CPU platform takes no devices: its replicas see what the server sees
    assert "CUDA_VISIBLE_DEVICES" not in placements(EngineConfig(platform="cpu"), 2)[1].env


def test_one_replica_is_a_plain_engine():
    from paged.engine.async_engine import AsyncEngine

    assert type(make_engine(EngineConfig())) is AsyncEngine


# ---- a live server with two replicas -------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return rel.make_tiny_model(tmp_path_factory.mktemp("dp-tiny") / "tiny-llama")


@pytest.fixture(scope="module")
def dp(tiny, tmp_path_factory) -> rel.Server:
    log = tmp_path_factory.mktemp("dp-server") / "server.log"
    srv = rel.start_server([tiny, *ARGS, "--data-parallel-size", "2"], log)
    yield srv
    rel.stop_server(srv)


@pytest.fixture(scope="module")
def reference(tiny) -> dict[str, str]:
    """Greedy completions of PROMPTS by one engine, offline, with the server's flags."""
    from paged import LLM
    from paged.sampling.params import SamplingParams

    llm = LLM(tiny, dtype="float32", max_model_len=512, kv_cache_memory="16MiB")
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    return {p: o.outputs[0].text for p, o in zip(PROMPTS, outs)}


def per_replica(srv: rel.Server, name: str) -> dict[str, float]:
    """{replica: value} of a paged:replica_<name> series."""
    out = {}
    for fam in text_string_to_metric_families(httpx.get(srv.url + "/metrics").text):
        for s in fam.samples:
            if s.name == f"paged:replica_{name}":
                assert s.labels["platform"] == "cpu"
                out[s.labels["replica"]] = s.value
    return out


def core_pids(srv: rel.Server) -> list[int]:
    """The engine core processes: the server's children running the spawn bootstrap."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmd = (stat.parent / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == srv.proc.pid and b"spawn_main" in cmd:
            pids.append(int(stat.parent.name))
    return pids


def complete(srv: rel.Server, prompt, **kw) -> dict:
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, **kw}
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_two_replicas_serve_and_spread_requests(dp):
    assert len(core_pids(dp)) == 2
    assert per_replica(dp, "ready") == {"0": 1.0, "1": 1.0}
    before = per_replica(dp, "prompt_tokens_total")
    with ThreadPoolExecutor(8) as pool:  # concurrent requests
        list(pool.map(lambda p: complete(dp, p), PROMPTS * 2))
    after = per_replica(dp, "prompt_tokens_total")
    assert all(after[r] > before[r] for r in ("0", "1")), (before, after)
    assert per_replica(dp, "outstanding_tokens") == {"0": 0.0, "1": 0.0}
    text = httpx.get(dp.url + "/metrics").text  # the totals: the sums over the replicas
    total = rel.metric(text, "paged:prompt_tokens_total")
    assert total == sum(per_replica(dp, "prompt_tokens_total").values())
    assert rel.metric(text, "paged:num_kv_blocks") == sum(per_replica(dp, "num_kv_blocks").values())


def test_greedy_outputs_equal_one_engine(dp, reference):
    for _ in range(2):  # each prompt on both replicas (idle replicas take turns)
        for p in PROMPTS:
            assert complete(dp, p)["choices"][0]["text"] == reference[p], p


def test_openai_client_and_streaming(dp, reference):
    import openai

    client = openai.OpenAI(base_url=dp.url + "/v1", api_key="x", max_retries=0, timeout=60)
    for p in PROMPTS[:2]:
        stream = client.completions.create(
            model="", prompt=p, max_tokens=24, temperature=0, stream=True
        )
        assert "".join(c.choices[0].text for c in stream) == reference[p]
    chat = client.chat.completions.create(
        model="", messages=[{"role": "user", "content": "Hi!"}], max_tokens=8, temperature=0
    )
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 8


def test_requests_go_to_the_least_loaded_replica(dp):
    body = {"prompt": "long", "max_tokens": 480, "n": 4, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", dp.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        load = per_replica(dp, "outstanding_tokens")
        busy = max(load, key=load.get)
        idle = "1" if busy == "0" else "0"
        assert load[busy] > 1000 and load[idle] == 0, load
        before = per_replica(dp, "prompt_tokens_total")
        for p in PROMPTS:
            complete(dp, p, max_tokens=2)
        still = per_replica(dp, "outstanding_tokens")[busy]
        after = per_replica(dp, "prompt_tokens_total")
        events = [ln[6:] for ln in lines if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert still > 0, "the long request ended before the short ones: routing not tested"
    assert after[busy] == before[busy] and after[idle] > before[idle], (before, after)


def test_a_dead_replica_ends_its_streams_and_is_restarted(dp):
    """A replica killed mid-stream: its stream ends with an error event (it had produced
    tokens: no retry), the other replica's stream finishes, and the replica comes back."""
    body = {"prompt": "hello", "max_tokens": 480, "ignore_eos": True, "stream": True}
    victim = core_pids(dp)[0]
    with contextlib.ExitStack() as stack:
        lines = []
        for _ in range(2):  # one on each replica: the second goes to the idle one
            url = dp.url + "/v1/completions"
            r = stack.enter_context(httpx.stream("POST", url, json=body, timeout=60))
            lines.append(r.iter_lines())
            assert next(lines[-1]).startswith("data: ")
        assert min(per_replica(dp, "outstanding_tokens").values()) > 0
        os.kill(victim, signal.SIGKILL)
        ends = []
        for it in lines:
            events = [ln[6:] for ln in it if ln.startswith("data: ")]
            assert events[-1] == "[DONE]"
            ends.append(json.loads(events[-2]).get("error"))
    (err,) = [e for e in ends if e is not None]  # the healthy replica's stream finished
    assert "engine" in err["message"] and err["type"] == "service_unavailable"
    deadline = time.monotonic() + 180
    while per_replica(dp, "restarts_total") != {"0": 1.0, "1": 0.0} or not all(
        per_replica(dp, "ready").values()
    ):
        assert time.monotonic() < deadline, "the replica did not come back"
        time.sleep(0.2)
    assert len(core_pids(dp)) == 2 and victim not in core_pids(dp)
    assert httpx.get(dp.url + "/health", timeout=5).status_code == 200
    for p in PROMPTS:
        complete(dp, p, max_tokens=2)
