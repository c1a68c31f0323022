"""The Ray executor on a local Ray cluster of two logical nodes (Ray's cluster utilities, one
CPU each): the worker actor lands on the other node, greedy outputs equal the `mp` executor's,
and a killed actor fails the engine in bounded time."""

from __future__ import annotations

import time

import pytest

ray = pytest.importorskip("ray")
# A two-node local Ray cluster (30-40 s on two cores): with the long checks (CI runs them).
pytestmark = pytest.mark.slow

from dist_helpers import generate_then_kill  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.placement_group import placement_group_table  # noqa: E402

from paged import LLM, SamplingParams  # noqa: E402
from paged.executor import WorkerFailure  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 60)), [3] * 20]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
ENGINE = dict(dtype="float32", num_kv_blocks=64, tensor_parallel_size=2)


@pytest.fixture(scope="module")
def ray_cluster():
    """A head node and a second node, one CPU each: a TP=2 replica needs both."""
    cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=1))
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def wait_for(cond, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.1)


def token_ids(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_ray_matches_mp_across_two_nodes(tiny_models, ray_cluster):
    path = tiny_models["llama"]
    mp = LLM(path, **ENGINE)
    try:
        ref = token_ids(mp)
    finally:
        mp.engine.shutdown()

    llm = LLM(path, **ENGINE, distributed_executor_backend="ray")
    try:
        ex = llm.engine.executor
        assert type(ex).__name__ == "RayExecutor"
        driver = ray.get_runtime_context().get_node_id()
        nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        assert len(nodes) == 2
        # bundle 0 (the driver's) on the driver's node, rank 1 on the other logical node
        placed = placement_group_table(ex.pg)["bundles_to_node_id"]
        assert placed[0] == driver and placed[1] in nodes - {driver}
        assert ex.bundle_nodes == [placed[0], placed[1]]
        assert ex.worker_nodes == [placed[1]]
        assert token_ids(llm) == ref
        assert ex.failure is None
    finally:
        llm.engine.shutdown()
    assert ex.actors == [] and ex.pg is None
    assert ex.failure is None  # a clean shutdown is no worker failure
    wait_for(lambda: ray.available_resources().get("CPU", 0) == 2)  # the bundles given back


def test_killed_actor_fails_the_engine_in_bounded_time(tiny_models, ray_cluster):
    llm = LLM(tiny_models["llama"], **ENGINE, distributed_executor_backend="ray")
    actor = llm.engine.executor.actors[0]
    err, hung, seconds = generate_then_kill(llm, lambda: ray.kill(actor, no_restart=True))
    assert not hung, "the engine hung after its worker actor died"
    assert isinstance(err, WorkerFailure | RuntimeError), err
    assert seconds < 30
    wait_for(lambda: llm.engine.executor.failure is not None)
    assert "worker rank 1" in llm.engine.executor.failure
    llm.engine.shutdown()
    assert llm.engine.executor.pg is None


def test_too_few_devices_is_refused_at_once(tiny_models, ray_cluster):
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="needs 4"):
        LLM(tiny_models["llama"], dtype="float32", num_kv_blocks=64, tensor_parallel_size=4,
            distributed_executor_backend="ray")  # fmt: skip
    assert time.monotonic() - t0 < 30
    assert ray.util.placement_group_table() == {} or all(
        pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values()
    )
