"""Fleet replicas placed by platform on a Ray cluster (paged.engine.ray_replicas).

A local cluster of two logical nodes (Ray's cluster utilities): the head, where the server
runs, advertises no platform; node B advertises `paged_platform_cpu`. A fleet of two cpu
replicas served with --ray-address lands both on node B as actors, answers like one engine,
and a killed actor comes back as a new one there; a group for a platform no node advertises
is refused, naming it. `paged fleet ray-resources` prints what a node advertises.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import time

import httpx
import pytest

ray = pytest.importorskip("ray")

from dist_helpers import TESTS, load_module  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

rel = load_module(
    "paged_rayfleet_reliability_helpers", TESTS / "reliability" / "reliability_helpers.py"
)
ARGS = {"dtype": "float32", "max_model_len": 256, "kv_cache_memory": "8MiB"}
PROMPTS = ["Hello, my name is", "The capital of France is"]


def test_ray_resources_lists_this_nodes_platforms():
    from paged.cli.main import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["fleet", "ray-resources"]) == 0
    res = json.loads(buf.getvalue())
    assert res.get("paged_platform_cpu") == 1 and all(
        k.startswith("paged_platform_") and v == 1 for k, v in res.items()
    )


@pytest.fixture(scope="module")
def cluster():
    """(cluster, node B's id): the head advertises no platform, node B the cpu one."""
    c = Cluster(initialize_head=True, head_node_args=dict(num_cpus=1))
    b = c.add_node(num_cpus=2, resources={"paged_platform_cpu": 1})
    ray.init(address=c.address)
    try:
        yield c, b.node_id
    finally:
        ray.shutdown()
        c.shutdown()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return rel.make_tiny_model(tmp_path_factory.mktemp("ray-fleet") / "tiny-llama")


@pytest.fixture(scope="module")
def server(cluster, tiny, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ray-fleet-server")
    path = tmp / "fleet.yaml"
    fleet = {"model": tiny, "args": ARGS, "replicas": [{"platform": "cpu", "count": 2}]}
    path.write_text(json.dumps(fleet))
    args = ["--fleet", str(path), "--ray-address", cluster[0].address, "--router", "round-robin"]
    srv = rel.start_server(args, tmp / "server.log")
    yield srv
    assert rel.stop_server(srv) == 0  # drained, its actors stopped


def view(srv) -> dict:
    r = httpx.get(srv.url + "/fleet", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def complete(srv, prompt: str) -> str:
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0}
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.mark.slow  # a two-node Ray cluster (30 s to start on two cores): with the long checks
def test_replicas_land_on_the_node_with_their_platform_and_serve(cluster, tiny, server):
    from paged import LLM, SamplingParams

    rows = view(server)["replicas"]
    assert [r["health"] for r in rows] == ["ready", "ready"]
    assert [r["node_id"] for r in rows] == [cluster[1]] * 2  # node B: the only cpu one
    assert server.proc.pid not in {r["pid"] for r in rows}  # actors, not local children
    llm = LLM(tiny, **ARGS)
    ref = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    del llm
    for _ in range(2):  # round-robin: each prompt on both replicas
        for p, want in zip(PROMPTS, ref):
            assert complete(server, p) == want.outputs[0].text


@pytest.mark.slow  # a two-node Ray cluster (30 s to start on two cores): with the long checks
def test_a_killed_replica_actor_is_replaced_by_a_new_one(cluster, server):
    old = view(server)["replicas"][0]
    os.kill(old["pid"], signal.SIGKILL)  # the actor's process (this machine: logical nodes)
    end = time.monotonic() + 180
    while True:
        row = view(server)["replicas"][0]
        if row["health"] == "ready" and row["restarts"] == 1:
            break
        assert time.monotonic() < end, row
        time.sleep(0.2)
    assert row["pid"] != old["pid"] and row["node_id"] == cluster[1]
    for p in PROMPTS:
        assert complete(server, p)


@pytest.mark.slow  # a two-node Ray cluster (30 s to start on two cores): with the long checks
def test_a_platform_no_node_advertises_is_refused(cluster, tiny):
    from paged.config import EngineConfig
    from paged.engine.fleet import FleetError, build_fleet, parse_fleet

    fleet = parse_fleet(json.dumps({"model": tiny, "replicas": [{"platform": "example"}]}))
    want = "advertises the platform 'example' \\(resource paged_platform_example\\); nodes "
    with pytest.raises(FleetError, match=want + "advertise: cpu on 1 node\\."):
        build_fleet(fleet, EngineConfig(model=tiny), ray_address=cluster[0].address)
