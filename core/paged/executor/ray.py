"""Ranks 1.. of a replica as Ray actors, one per device, in a placement group that may span
nodes (`--distributed-executor-backend ray`).

Placement: one bundle per rank, `{"GPU": 1}` on CUDA/ROCm platforms and `{"CPU": 1}` on the
others (`ray_resource`). Bundle 0 is the driver's: it is pinned to the node of this process
(the engine) and only reserves the driver's device, nothing runs in it. The group is PACKed:
ranks fill the driver's node first, then spill onto other nodes. Ranks 1.. are actors in
bundles 1.., started with the environment the engine needs (`worker_env`); each joins the
replica's process group at `tcp://<driver node ip>:<free port>` (the driver hosts the store).

Devices: Ray gives a GPU actor its own device through CUDA_VISIBLE_DEVICES, so it binds
device 0 of what it sees; the driver binds device 0 of its own process, which is the GPU that
bundle 0 reserves on an otherwise idle node. With other resources (CPU bundles) a rank binds
its position among the group's bundles on its node.

Failures: a thread watches the actors' `run` calls. One that ends before shutdown (the actor
died, or raised) marks the replica failed, the others are stopped, and the driver's next step
raises WorkerFailure; an engine-core process exits after a grace period if the driver is stuck
in a collective with the dead rank, as with `mp`.
"""

from __future__ import annotations

import inspect
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any

from paged.config import EngineConfig
from paged.executor.base import Executor

log = logging.getLogger("paged")

PLACEMENT_TIMEOUT_S = 300.0  # for the placement group's bundles and the actors to come up
STOP_WAIT_S = 5.0  # for the ranks to leave their process group after the driver's STOP
# What the actors inherit from the engine's environment (a worker on another node does not
# see this process's variables): paged's own settings, the Hugging Face hub / cache ones.
ENV_PREFIXES = ("PAGED_", "HF_", "TRANSFORMERS_")
ENV_NAMES = ("PYTHONPATH", "TOKENIZERS_PARALLELISM")


def ray_resource(device_type: str) -> str:
    """The Ray resource one rank reserves for a platform's torch device type: "GPU" for CUDA
    and ROCm (whose torch device type is also "cuda"), "CPU" for everything else."""
    return "GPU" if device_type in ("cuda", "rocm") else "CPU"


def worker_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items() if k.startswith(ENV_PREFIXES) or k in ENV_NAMES}


def free_port() -> int:
    """A free TCP port on every interface of this host (workers on other nodes connect)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def connect() -> None:
    """Join the Ray cluster unless this process already has: `ray.init()` connects to
    RAY_ADDRESS when set, else to a cluster started on this machine (`ray start`), else starts
    a local one."""
    import ray

    if ray.is_initialized():
        return
    ray.init(address=os.environ.get("RAY_ADDRESS") or None)


class RankActor:
    """One rank in its Ray actor (made remote in `RayExecutor.start_workers`)."""

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def run(self, config: EngineConfig, rank: int, init_method: str, local_rank: int,
            log_level: int) -> None:  # fmt: skip
        """Build this rank's part, size and allocate its KV cache in step with the others,
        then follow the driver's steps until it says stop (only then does this return)."""
        from paged.distributed import destroy_distributed
        from paged.logs import LOG_FORMAT
        from paged.worker.worker import Worker, follow_steps

        logging.basicConfig(format=LOG_FORMAT)
        logging.getLogger("paged").setLevel(log_level)
        worker = Worker(config, rank, init_method, local_rank)
        worker.init_cache(worker.num_blocks())
        follow_steps(worker)
        destroy_distributed()


class RayExecutor(Executor):
    def __init__(self, config: EngineConfig, exit_on_failure: bool = False) -> None:
        self.exit_on_failure = exit_on_failure
        self.pg: Any = None
        self.actors: list = []
        self.runs: list = []  # the actors' run() refs, rank 1.. in order
        self.bundle_nodes: list[str] = []  # the node id of each rank's bundle, rank 0 first
        self.worker_nodes: list[str] = []  # the node id each actor reported, rank 1.. in order
        self._stopping = False
        self._lock = threading.Lock()
        super().__init__(config)

    # ---- start ------------------------------------------------------------------------
    def start_workers(self) -> str:
        try:
            import ray
        except ImportError as e:
            raise ImportError(
                "distributed_executor_backend='ray' needs Ray: pip install 'paged[ray]'"
            ) from e
        connect()
        try:
            return self._start(ray)
        except BaseException:
            self.stop_workers()
            raise

    def _start(self, ray: Any) -> str:
        from ray.util.placement_group import placement_group, placement_group_table
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from paged.plugins import select_platform

        world = self.config.world_size
        resource = ray_resource(select_platform(self.config.platform).device_type)
        have = ray.cluster_resources().get(resource, 0)
        if have < world:
            raise RuntimeError(
                f"the Ray cluster has {have:g} {resource}, the replica needs {world} (one per "
                f"rank: tensor_parallel_size x pipeline_parallel_size)"
            )
        bundles: list[dict[str, float]] = [{resource: 1.0} for _ in range(world)]
        driver_node = ray.get_runtime_context().get_node_id()
        kw: dict[str, Any] = {}
        if "bundle_label_selector" in inspect.signature(placement_group).parameters:
            # Every node carries its own id as a label: bundle 0 lands on this very node.
            kw["bundle_label_selector"] = [{"ray.io/node-id": driver_node}] + [{}] * (world - 1)
        else:  # older Ray: the node's IP resource (ambiguous only with several nodes per IP)
            bundles[0][f"node:{ray.util.get_node_ip_address()}"] = 0.001
        tag = f"paged-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.pg = placement_group(bundles, strategy="PACK", name=tag, **kw)
        t0 = time.monotonic()
        ready = self.pg.ready()
        while True:
            done, _ = ray.wait([ready], timeout=10.0)
            if done:
                ray.get(ready)
                break
            waited = time.monotonic() - t0
            if waited > PLACEMENT_TIMEOUT_S:
                raise RuntimeError(
                    f"Ray could not place {world} x {{{resource}: 1}} (bundle 0 on the "
                    f"driver's node {driver_node}) in {waited:.0f} s; available: "
                    f"{ray.available_resources()}"
                )
            log.info("waiting for Ray to place %d x %s (%.0f s)", world, resource, waited)
        placed = placement_group_table(self.pg)["bundles_to_node_id"]
        self.bundle_nodes = [placed[i] for i in range(world)]
        log.info("Ray placement group: ranks on nodes %s", self.bundle_nodes)

        init_method = f"tcp://{ray.util.get_node_ip_address()}:{free_port()}"
        gpu = resource == "GPU"
        remote = ray.remote(RankActor)
        env = worker_env()
        level = logging.getLogger("paged").getEffectiveLevel()
        for rank in range(1, world):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=self.pg, placement_group_bundle_index=rank
            )
            actor = remote.options(
                num_cpus=0 if gpu else 1,
                num_gpus=1 if gpu else 0,
                scheduling_strategy=strategy,
                runtime_env={"env_vars": env},
                max_restarts=0,
                name=f"{tag}-rank-{rank}",
            ).remote()
            self.actors.append(actor)
        # The actors are up (their environment set up, paged importable) before anyone waits
        # in the process group's rendezvous, so that a broken node fails here, with its error.
        nodes = ray.get([a.node_id.remote() for a in self.actors], timeout=PLACEMENT_TIMEOUT_S)
        self.worker_nodes = list(nodes)
        for rank, actor in enumerate(self.actors, start=1):
            node = self.bundle_nodes[rank]
            # GPU actors see one device (Ray sets CUDA_VISIBLE_DEVICES); otherwise a rank's
            # device is its position among the ranks on its node (the driver's is 0).
            local = 0 if gpu else self.bundle_nodes[:rank].count(node)
            self.runs.append(actor.run.remote(self.config, rank, init_method, local, level))
        threading.Thread(target=self._watch, args=(ray,), name="paged-ray-watch",
                         daemon=True).start()  # fmt: skip
        return init_method

    # ---- watch ------------------------------------------------------------------------
    def _watch(self, ray: Any) -> None:
        pending = list(self.runs)
        while pending and not self._stopping:
            try:
                done, pending = ray.wait(pending, num_returns=1, timeout=1.0)
            except Exception:  # Ray shut down under us
                if self._stopping or not ray.is_initialized():
                    return
                raise
            if not done or self._stopping:
                continue
            rank = self.runs.index(done[0]) + 1
            try:
                ray.get(done[0])
                why = "stopped before the replica was shut down"
            except Exception as e:
                log.error("worker rank %d failed:\n%s", rank, e)
                lines = str(e).strip().splitlines()  # the last says why (or is the error)
                why = f"died: {type(e).__name__}: {lines[-1].strip() if lines else ''}"
            if self._stopping:
                return
            self.worker_died(f"worker rank {rank} (Ray actor) {why}")
            return

    # ---- stop -------------------------------------------------------------------------
    def stop_workers(self) -> None:
        self._stopping = True
        with self._lock:
            actors, pg = self.actors, self.pg
            self.actors, self.pg = [], None
        if not actors and pg is None:
            return
        import ray

        if not ray.is_initialized():  # Ray is gone, and the actors with it
            return
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as e:
                log.debug("ray.kill: %s", e)
        if pg is not None:
            try:
                ray.util.remove_placement_group(pg)
            except Exception as e:
                log.debug("remove_placement_group: %s", e)

    def shutdown(self) -> None:
        self._stopping = True
        try:
            if self.failure is None:
                self.driver.shutdown()  # STOP to every rank; their run() returns
                import ray

                if self.runs and ray.is_initialized():
                    ray.wait(self.runs, num_returns=len(self.runs), timeout=STOP_WAIT_S)
        finally:
            self.stop_workers()
            from paged.distributed import destroy_distributed

            destroy_distributed()
