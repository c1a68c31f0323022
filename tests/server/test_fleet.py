"""`paged serve --fleet FLEET.yaml`: replica groups on several platforms behind one server
(paged.engine.fleet), routed by paged.engine.router.

Unit tests of the routing policies on fake replicas first; then one server for the module:
two `cpu` replicas and one on the out-of-tree example plugin's platform (examples/oot-plugin,
installed with pip --target), on a tiny random model in float32. Each replica's greedy output
equals one offline engine's on its platform, /fleet and `paged fleet status` list the three
with their platforms, and the prefix router keeps requests sharing a long prefix on one replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import subprocess
import sys

import httpx
import pytest
import rel

from paged.engine.async_engine import EngineDeadError
from paged.engine.replicas import Replica, ReplicaSet
from paged.engine.router import DEFAULT_SPEED, PrefixIndex, Router, block_hashes
from paged.server.errors import APIError

PROMPTS = ["Hello, my name is", "The capital of France is", "1 2 3 4 5", "Once upon a time"]
PROMPTS += ["Paris is", "The sky"]
FLEET = """\
model: {model}
args: {{dtype: float32, max_model_len: 512, kv_cache_memory: 16MiB}}
replicas:
  - {{platform: cpu, count: 2}}
  - {{platform: example, count: 1}}
"""


# ---- the policies, without processes -------------------------------------------------------
class FakeEngine:
    def __init__(self, platform: str = "cpu", max_model_len: int = 512) -> None:
        self.outstanding_tokens = 0
        self.ready, self.dead, self.on_dead, self.observer = True, None, None, None
        self.info = dict(max_model_len=max_model_len, num_blocks=64, block_size=16, pid=1,
                         platform=platform)  # fmt: skip
        self.stats: dict = {}
        self.sent: list[str] = []

    def generate(self, request_id, prompt_ids, params, lora_request=None, user=None):
        self.sent.append(request_id)
        return iter(())

    def silent_for(self):
        return 0.1

    async def wait_ready(self):
        return self.ready

    def fail(self, reason):
        self.dead, self.ready = self.dead or reason, False


class Params:
    def __init__(self, max_tokens=16):
        self.max_tokens = max_tokens


def fake_set(router: str, *engines: FakeEngine) -> ReplicaSet:
    return ReplicaSet([Replica(i, e) for i, e in enumerate(engines)], False, router)


def counts(engines) -> list[int]:
    return [len(e.sent) for e in engines]


def test_prefix_router_keeps_a_shared_prefix_on_one_replica_round_robin_spreads():
    prefix = list(range(100, 164))  # four 16-token blocks
    engines = [FakeEngine(), FakeEngine(), FakeEngine("example")]
    rs = fake_set("prefix", *engines)
    for i in range(6):
        rs.generate(f"p{i}", prefix + [i], Params())
    assert sorted(counts(engines)) == [0, 0, 6]
    held = next(r for r in rs.replicas if r.engine.sent)
    assert len(held.prefix) == 4
    for i in range(3):  # other prompts (no full block) take turns
        rs.generate(f"s{i}", [i], Params())
    assert sorted(counts(engines)) == [1, 1, 7]
    rr = [FakeEngine(), FakeEngine(), FakeEngine("example")]
    rs = fake_set("round-robin", *rr)
    for i in range(6):
        rs.generate(f"p{i}", prefix + [i], Params())
    assert counts(rr) == [2, 2, 2]


def test_prefix_router_weighs_load_by_speed_against_the_cached_prefix():
    a, b = FakeEngine(), FakeEngine()
    rs = fake_set("prefix", a, b)
    ra, rb = rs.replicas
    prompt = list(range(320))  # 20 blocks
    ra.prefix.add(block_hashes(prompt))
    a.outstanding_tokens = 100  # 0.1 s of work at the default speed; its prefix saves 0.32 s
    assert rs.route(prompt, Params()) is ra
    a.outstanding_tokens = 1000  # 1 s of work: more than the prefix saves
    assert rs.route(prompt, Params()) is rb
    ra.speed = 10 * DEFAULT_SPEED  # ... unless it is ten times faster
    assert rs.route(prompt, Params()) is ra
    rb.speed, b.outstanding_tokens = 1.0, 10  # a slow replica's little work is a long wait
    assert rs.route([1, 2], Params()) is ra


def test_routers_never_pick_a_replica_too_small_for_the_request():
    small, big = FakeEngine(max_model_len=128), FakeEngine(max_model_len=512)
    for policy in ("prefix", "least-load", "round-robin"):
        rs = fake_set(policy, small, big)
        small.outstanding_tokens, big.outstanding_tokens = 0, 10_000
        for _ in range(3):
            assert rs.route([1] * 100, Params(max_tokens=100)).engine is big
        assert rs.info["max_model_len"] == 512  # a fleet takes what fits somewhere
        with pytest.raises(APIError) as e:  # fits nowhere: the 400 of a single engine
            rs.route([1] * 600, Params(1))
        assert (e.value.status, e.value.param) == (400, "prompt")
        assert e.value.code == "context_length_exceeded" and "length is 512 tokens" in str(e.value)
        with pytest.raises(APIError) as e:
            Router(policy).pick([small, big], [1] * 400, 200)
        assert e.value.param == "max_tokens" and "600 were requested" in str(e.value)
    with pytest.raises(ValueError, match="unknown router"):
        Router("fastest")


def test_prefix_index_is_a_bounded_lru():
    idx = PrefixIndex(3)
    h = block_hashes(list(range(80)))  # 5 blocks, chained: a block's hash names its prefix
    assert len(h) == 5 and block_hashes(list(range(80)) + [1]) == h
    assert block_hashes([7] * 16 + list(range(16)))[1] != block_hashes(list(range(32)))[1]
    idx.add(h[:2])
    assert idx.hits(h) == 2
    idx.add(h[2:])
    assert len(idx) == 3 and idx.hits(h) == 0  # the first blocks were evicted


def test_replicas_learn_their_speed_from_the_outputs_they_return(monkeypatch):
    from types import SimpleNamespace

    import paged.engine.replicas as replicas

    monkeypatch.setattr(replicas, "SPEED_WINDOW_S", 0.0)  # a sample per output
    clock = iter([0.0, 0.0, 0.5, 1.0, 1.5])  # sent, started, then one output every 0.5 s
    monkeypatch.setattr(replicas, "time", SimpleNamespace(monotonic=lambda: next(clock)))

    class Streaming(FakeEngine):
        async def generate(self, request_id, prompt_ids, params, lora_request=None, user=None):
            for _ in range(3):
                yield SimpleNamespace(output=SimpleNamespace(new_token_ids=[1, 2]))

    r = Replica(0, Streaming())

    async def run():
        return [u async for u in r.generate("a", [5] * 98, Params())]

    assert len(asyncio.run(run())) == 3
    assert r.prefill_speed == pytest.approx(98 / 0.5)  # prompt tokens / time to first token
    # samples: 100 tokens (the prompt, the first two) in 0.5 s, then twice 2 in 0.5 s
    assert r.speed == pytest.approx(0.7 * (0.7 * 200 + 0.3 * 4) + 0.3 * 4)


def test_closing_a_replica_stream_early_closes_the_engine_stream():
    from types import SimpleNamespace

    closed = []

    class Streaming(FakeEngine):
        async def generate(self, request_id, prompt_ids, params, lora_request=None, user=None):
            try:
                while True:
                    yield SimpleNamespace(output=SimpleNamespace(new_token_ids=[1]))
            finally:
                closed.append(request_id)  # AsyncEngine aborts the request here

    async def run():
        it = Replica(0, Streaming()).generate("a", [1, 2], Params())
        await it.__anext__()
        await it.aclose()  # the client went away

    asyncio.run(run())
    assert closed == ["a"]


def test_mixed_platforms_pass_for_a_fleet_not_for_data_parallel():
    rs = fake_set("prefix", FakeEngine("cpu"), FakeEngine("example"))
    assert asyncio.run(rs.wait_ready()) and rs.info["platforms"] == ["cpu", "example"]
    dp = ReplicaSet([Replica(0, FakeEngine("cpu")), Replica(1, FakeEngine("example"))])
    assert asyncio.run(dp.wait_ready()) is False and "different platforms" in dp.dead


# ---- restarts and retries, without processes ---------------------------------------------
class Restartable(FakeEngine):
    """Starts ready (or dead when `ok` is False); generate yields `tokens` updates, then ends,
    or raises EngineDeadError when `dies`."""

    def __init__(self, ok: bool = True, tokens: int = 1, dies: bool = False) -> None:
        super().__init__()
        self.ok, self.tokens, self.dies = ok, tokens, dies
        self.shut = False

    def start(self):
        self.ready = self.ok
        if not self.ok:
            self.fail("start-up failed")

    async def shutdown(self, timeout=5.0):
        self.shut = True

    def fail(self, reason):
        if self.dead is None:
            self.dead, self.ready = reason, False
            if self.on_dead:
                self.on_dead()

    def abort(self, request_id):
        pass

    async def generate(self, request_id, prompt_ids, params, lora_request=None, user=None):
        from types import SimpleNamespace

        from paged.engine.async_engine import EngineDeadError

        self.sent.append(request_id)
        for _ in range(self.tokens):
            yield SimpleNamespace(output=SimpleNamespace(new_token_ids=[7]))
        if self.dies:
            self.fail("killed")
            raise EngineDeadError("killed")


async def until(cond) -> None:
    for _ in range(1000):
        if cond():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("timed out")


def test_dead_replicas_restart_and_the_set_fails_only_when_none_can(monkeypatch):
    import paged.engine.replicas as replicas

    monkeypatch.setattr(replicas, "RESTART_BACKOFF_S", 0.0)
    starts = {"ok": True, "made": 0}

    def factory() -> Restartable:
        starts["made"] += 1
        return Restartable(ok=starts["ok"])

    async def run():
        a, b = (Replica(i, Restartable(), factory=factory) for i in range(2))
        rs = ReplicaSet([a, b], False, "round-robin")
        fired = []
        rs.on_dead = lambda: fired.append(1)
        assert await rs.wait_ready()
        old = a.engine
        old.fail("the engine core process exited (code -9)")
        assert a.health == "restarting" and not a.ready and rs.ready  # b serves meanwhile
        assert all(rs.route([1], Params()) is b for _ in range(3))  # out of the rotation
        await until(lambda: a.health == "ready")
        assert a.restarts == 1 and a.engine is not old and old.shut and starts["made"] == 1
        starts["ok"] = False  # from now on no start succeeds
        b.engine.fail("killed")
        await until(lambda: b.health == "dead")
        assert starts["made"] == 1 + replicas.MAX_RESTARTS and b.restarts == 0
        assert "3 restarts in a row failed" in b.dead and rs.dead is None and rs.ready
        assert not fired
        a.engine.fail("killed")  # a's streak goes on: it was not up STABLE_S
        await until(lambda: rs.dead is not None)
        assert fired == [1] and not rs.ready and "every replica is dead" in rs.dead
        assert starts["made"] == 1 + replicas.MAX_RESTARTS + 2
        with pytest.raises(EngineDeadError):  # a 503, not a 400: no replica is left at all
            [u async for u in rs.generate("late", [1], Params())]
        await rs.shutdown()

    asyncio.run(run())


def test_a_request_waits_for_the_restarting_replica_that_fits_it_never_a_smaller_one(
    monkeypatch,
):
    """The 1024-token replica restarts while a 128-token one serves: a request that only the
    large one holds waits for it (the small one would cut its answer short); one that fits
    both goes to the small one meanwhile; with the large one dead for good, the fleet's
    context is the small one's and the request gets the 400 of a single engine."""
    import paged.engine.replicas as replicas

    monkeypatch.setattr(replicas, "RESTART_BACKOFF_S", 0.0)
    gate = asyncio.Event()
    starts = {"ok": True}

    class Slow(Restartable):  # a restart that is ready once the test says so
        async def wait_ready(self):
            await gate.wait()
            return self.ready

    def big_factory():
        e = Slow(ok=starts["ok"])
        e.info["max_model_len"] = 1024
        return e

    async def run():
        small = Restartable()
        small.info["max_model_len"] = 128
        big = Restartable()
        big.info["max_model_len"] = 1024
        rs = ReplicaSet([Replica(0, small), Replica(1, big, factory=big_factory)], False,
                        "least-load")  # fmt: skip
        assert await rs.wait_ready() and rs.info["max_model_len"] == 1024
        big.fail("the engine core process exited (code -9)")
        assert rs.replicas[1].health == "restarting" and rs.ready
        prompt = [1] * 100
        assert rs.route(prompt, Params(50)) is None  # fits only the one restarting: wait
        task = asyncio.create_task(collect(rs, "long", prompt, 50))
        for _ in range(20):
            await asyncio.sleep(0)
        assert not task.done() and small.sent == []  # never the replica too small for it
        assert len(await collect(rs, "short", [1] * 10, 50)) == 1  # fits both: served now
        assert small.sent == ["short"]
        gate.set()  # the large replica is back: the request waiting goes there
        assert len(await asyncio.wait_for(task, 10)) == 1
        assert rs.replicas[1].engine.sent == ["long"]
        assert small.sent == ["short"] and rs.retried == 0
        starts["ok"] = False  # from now on the large one never comes back
        rs.replicas[1].engine.fail("killed")
        await until(lambda: rs.replicas[1].health == "dead")
        assert rs.info["max_model_len"] == 128 and rs.ready  # the server's 400 says 128 now
        with pytest.raises(APIError) as e:
            await collect(rs, "again", prompt, 50)
        assert e.value.status == 400 and e.value.code == "context_length_exceeded"
        assert e.value.param == "max_tokens" and "length is 128 tokens" in str(e.value)
        await rs.shutdown()

    async def collect(rs: ReplicaSet, rid: str, prompt: list[int], max_tokens: int) -> list:
        return [u async for u in rs.generate(rid, prompt, Params(max_tokens))]

    asyncio.run(run())


def test_a_request_without_tokens_is_retried_on_another_replica_one_with_is_not():
    async def collect(rs: ReplicaSet, rid: str) -> list:
        return [u async for u in rs.generate(rid, [1, 2], Params())]

    async def run():
        from paged.engine.async_engine import ReplicaLostError
        from paged.server.serving import api_error

        dying, healthy = Restartable(tokens=0, dies=True), Restartable()
        rs = ReplicaSet([Replica(0, dying), Replica(1, healthy)], False, "round-robin")
        assert await rs.wait_ready()
        got = await collect(rs, "a")  # sent to replica 0, which dies before any token
        assert len(got) == 1 and dying.sent == ["a"] and healthy.sent == ["a"]
        assert rs.retried == 1 and rs.dead is None  # no factory: replica 0 stays dead
        midway = Restartable(tokens=2, dies=True)
        rs = ReplicaSet([Replica(0, midway), Replica(1, Restartable())], False, "round-robin")
        assert await rs.wait_ready()
        with pytest.raises(ReplicaLostError) as e:  # tokens were out: the stream ends in an
            await collect(rs, "b")  # error that says the replica, not the server, stopped
        assert rs.retried == 0 and rs.dead is None
        err = api_error(e.value)
        assert err.status == 503 and "replica 0" in str(err) and "exiting" not in str(err)

    asyncio.run(run())


# ---- a live fleet: 2 x cpu + 1 x example ---------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return rel.make_tiny_model(tmp_path_factory.mktemp("fleet-tiny") / "tiny-llama")


@pytest.fixture(scope="module")
def example_env(oot_plugin_site) -> dict[str, str]:
    """The environment with examples/oot-plugin installed as a vendor would ship it."""
    return {"PYTHONPATH": oot_plugin_site + os.pathsep + os.environ.get("PYTHONPATH", "")}


REFERENCE = """
import json, sys
from paged import LLM, SamplingParams
prompts = json.loads(sys.argv[2])
out = {}
for platform in ("cpu", "example"):
    llm = LLM(sys.argv[1], dtype="float32", platform=platform, max_model_len=512,
              kv_cache_memory="16MiB")
    res = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    out[llm.engine.platform.name] = [r.outputs[0].text for r in res]
    del llm
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def reference(tiny, example_env) -> dict[str, dict[str, str]]:
    """{platform: {prompt: greedy text}} of one offline engine per platform."""
    env = {k: v for k, v in os.environ.items() if k != "PAGED_PLATFORM"} | example_env
    r = subprocess.run(
        [sys.executable, "-c", REFERENCE, tiny, json.dumps(PROMPTS)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    return {p: dict(zip(PROMPTS, texts)) for p, texts in out.items()}


@pytest.fixture(scope="module")
def fleet(tiny, example_env, tmp_path_factory) -> rel.Server:
    tmp = tmp_path_factory.mktemp("fleet-server")
    path = tmp / "fleet.yaml"
    path.write_text(FLEET.format(model=tiny))
    srv = rel.start_server(["--fleet", str(path)], tmp / "server.log", example_env)
    yield srv
    rel.stop_server(srv)


def view(srv: rel.Server) -> dict:
    r = httpx.get(srv.url + "/fleet", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def prompt_tokens(srv: rel.Server) -> list[float]:
    return [r["prompt_tokens"] for r in view(srv)["replicas"]]


def test_fleet_lists_its_replicas_and_platforms(fleet):
    v = view(fleet)
    assert v["router"] == "prefix"
    assert [r["platform"] for r in v["replicas"]] == ["cpu", "cpu", "example"]
    assert [r["index"] for r in v["replicas"]] == [0, 1, 2]
    assert all(r["health"] == "ready" and r["silent_for"] < 5 for r in v["replicas"])
    assert len({r["pid"] for r in v["replicas"]}) == 3
    from paged.cli.main import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["fleet", "status", fleet.url]) == 0
    lines = buf.getvalue().splitlines()
    assert lines[0].split()[:4] == ["#", "platform", "pid", "health"]
    assert [ln.split()[1] for ln in lines[1:4]] == ["cpu", "cpu", "example"]
    assert lines[-1] == "router: prefix"


def test_each_replica_answers_like_one_engine_on_its_platform(fleet, reference):
    import openai

    client = openai.OpenAI(base_url=fleet.url + "/v1", api_key="x", max_retries=0, timeout=60)
    platforms = [r["platform"] for r in view(fleet)["replicas"]]
    served = set()
    for p in PROMPTS:  # one at a time: idle replicas take turns
        before = prompt_tokens(fleet)
        out = client.completions.create(model="", prompt=p, max_tokens=24, temperature=0)
        after = prompt_tokens(fleet)
        (which,) = [i for i in range(3) if after[i] > before[i]]
        served.add(which)
        assert out.choices[0].text == reference[platforms[which]][p], (p, platforms[which])
    assert served == {0, 1, 2}
    assert reference["cpu"] == reference["example"]  # the plugin computes what cpu does


def test_prefix_router_keeps_a_long_shared_prefix_on_one_replica(fleet):
    shared = "In a quiet village at the edge of the northern forest there lived " * 8
    before = prompt_tokens(fleet)
    for i in range(4):
        body = {"prompt": shared + f"story number {i}:", "max_tokens": 2, "temperature": 0}
        r = httpx.post(fleet.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
    after = prompt_tokens(fleet)
    got = [i for i in range(3) if after[i] > before[i]]
    assert len(got) == 1, (before, after)
    rows = view(fleet)["replicas"]
    assert rows[got[0]]["prefix_blocks"] >= 4
    assert rows[got[0]]["prefill_tokens_per_s"] > 0  # measured from what came back
    text = httpx.get(fleet.url + "/metrics").text
    assert "paged:replica_speed_tokens_per_second{model_name=" in text
    assert 'platform="example",replica="2"' in text


@pytest.mark.slow  # a second fleet (20 s): turns tested above, the flag in test_fleet_restart
def test_round_robin_spreads_a_shared_prefix(tiny, tmp_path):
    """A second, smaller fleet (two cpu replicas) with --router round-robin."""
    path = tmp_path / "fleet.json"  # JSON is YAML too
    fl = {"model": tiny, "args": {"dtype": "float32", "max_model_len": 256,
                                  "kv_cache_memory": "8MiB"},
          "replicas": [{"platform": "cpu", "count": 2}]}  # fmt: skip
    path.write_text(json.dumps(fl))
    srv = rel.start_server(["--fleet", str(path), "--router", "round-robin"], tmp_path / "log")
    try:
        assert view(srv)["router"] == "round-robin"
        shared = "In a quiet village at the edge of the northern forest there lived " * 4
        for i in range(4):
            body = {"prompt": shared + f"story {i}:", "max_tokens": 2, "temperature": 0}
            r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
        tokens = prompt_tokens(srv)
        assert tokens[0] > 0 and tokens[1] > 0 and abs(tokens[0] - tokens[1]) < 10, tokens
    finally:
        rel.stop_server(srv)
