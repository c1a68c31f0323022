"""Fleet replicas as Ray actors (`paged serve --fleet FLEET.yaml --ray-address ADDR`).

Nodes advertise the platforms they can run as Ray custom resources, `paged_platform_<name>: 1`
for every platform `paged platforms` finds available there; `paged fleet ray-resources` prints
them as the JSON `ray start --resources` takes, so `ray start` is the only per-node step.

A replica is one actor running the engine core (`async_engine._core_main`, as the local
engine-core process does). It requires UNIT of its platform's resource (a marker: how many
fit on a node is bounded by the CPUs and GPUs it also requires), the group's `num_cpus`
(its torch threads) and, on CUDA/ROCm platforms, one GPU per rank. The server binds its two
ZMQ sockets on its node's address over TCP and the actor connects to them; everything else is
what a local replica does. The actor's end (it raised, was killed, or its node died) is its
process's exit: the replica is restarted as a new actor (`max_restarts=0`: the replica set
restarts it, with the same bounded attempts as a local process). Ray ends the actors with
their owner, the server.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import uuid
from collections.abc import Callable
from typing import Any

from paged.engine.async_engine import AsyncEngine, _core_main

log = logging.getLogger("paged")
PREFIX = "paged_platform_"
UNIT = 0.001  # of its platform's resource one replica takes


def resource_name(platform: str) -> str:
    """The Ray custom resource that says a node runs `platform`."""
    return PREFIX + re.sub(r"[^A-Za-z0-9_]", "_", platform)


def node_resources() -> dict[str, float]:
    """{paged_platform_<name>: 1} for every platform available on this machine."""
    from paged.plugins import probe_platforms

    rows = probe_platforms()
    return {resource_name(r.name): 1.0 for r in rows if r.available and r.cls is not None}


def connect(address: str) -> Any:
    """Join the Ray cluster at `address` (or "auto") unless this process already has."""
    import ray

    if not ray.is_initialized():
        ray.init(address=address, logging_level=logging.WARNING)
    return ray


def check_platforms(platforms: list[str]) -> None:
    """RuntimeError unless some live node of the cluster advertises each platform."""
    import ray

    have: dict[str, list[str]] = {}
    for node in ray.nodes():
        if node.get("Alive"):
            for key in node.get("Resources", {}):
                if key.startswith(PREFIX):
                    have.setdefault(key, []).append(node["NodeID"])
    missing = sorted({p for p in platforms if resource_name(p) not in have})
    if missing:
        found = ", ".join(
            f"{k[len(PREFIX) :]} on {len(v)} node{'s' * (len(v) != 1)}"
            for k, v in sorted(have.items())
        )
        raise RuntimeError(
            f"no node of the Ray cluster advertises the platform "
            f"{', '.join(repr(p) for p in missing)} (resource "
            f"{', '.join(resource_name(p) for p in missing)}); nodes advertise: "
            f"{found or 'none'}. Start each node with ray start --resources "
            f'"$(paged fleet ray-resources)" (docs/fleet.md)'
        )


def actor_options(platform: str, world_size: int, num_cpus: int) -> dict[str, Any]:
    """Ray options of a replica's actor: its platform marker, CPUs, and GPUs on CUDA/ROCm."""
    from paged.executor.ray import ray_resource, worker_env
    from paged.plugins import all_platforms

    kind = next((c.device_type for c in all_platforms() if c.name == platform), "cpu")
    gpus = world_size if ray_resource(kind) == "GPU" else 0
    return {
        "num_cpus": num_cpus,
        "num_gpus": gpus,
        "resources": {resource_name(platform): UNIT},
        "runtime_env": {"env_vars": worker_env()},
        "max_restarts": 0,
    }


class CoreActor:
    """The engine core in a Ray actor (made remote in ActorProcess.start)."""

    def node(self) -> tuple[str, str]:
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def run(self, *args: Any) -> None:
        _core_main(*args)


class ActorProcess:
    """The part of multiprocessing.Process an AsyncEngine uses (start, sentinel, is_alive,
    join, kill, exitcode) over a CoreActor: the sentinel is a pipe written when the actor's
    run ends, however it ends."""

    def __init__(self, args: tuple, options: dict[str, Any], name: str,
                 on_node: Callable[[str, str], None]) -> None:  # fmt: skip
        self.args, self.options, self.name, self.on_node = args, options, name, on_node
        self.exitcode: int | None = None
        self.actor: Any = None
        self._ended = threading.Event()
        self._r, self._w = os.pipe()

    @property
    def sentinel(self) -> int:
        return self._r

    def start(self) -> None:
        import ray

        name = f"{self.name}-{uuid.uuid4().hex[:8]}"
        self.actor = ray.remote(CoreActor).options(name=name, **self.options).remote()
        where = self.actor.node.remote()  # before run: the actor runs one call at a time
        done = self.actor.run.remote(*self.args)
        threading.Thread(target=self._watch, args=(ray, where, done), name=f"{name}-watch",
                         daemon=True).start()  # fmt: skip

    def _watch(self, ray: Any, where: Any, done: Any) -> None:
        try:
            self.on_node(*ray.get(where))
            ray.get(done)
            self.exitcode = 0
        except Exception as e:  # it raised, was killed, or its node died
            lines = str(e).strip().splitlines()
            log.error("%s: the engine core actor ended: %s", self.name, lines[-1] if lines else e)
            self.exitcode = 1
        self.kill()  # an idle actor still holds its resources
        self._ended.set()
        os.write(self._w, b"x")

    def is_alive(self) -> bool:
        return not self._ended.is_set()

    def join(self, timeout: float | None = None) -> None:
        self._ended.wait(timeout)

    def kill(self) -> None:
        import ray

        if self.actor is not None and ray.is_initialized():
            try:
                ray.kill(self.actor, no_restart=True)
            except Exception as e:
                log.debug("ray.kill: %s", e)

    def __del__(self) -> None:
        for fd in (self._r, self._w):
            try:
                os.close(fd)
            except OSError:
                pass


class RayEngine(AsyncEngine):
    """An AsyncEngine whose core runs in a Ray actor placed by `options` (actor_options)."""

    def __init__(self, *args: Any, options: dict[str, Any], **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.options = options
        self.node: str | None = None  # the actor's node address, once it runs
        self.node_id: str | None = None

    def _bind(self) -> tuple[str, str]:
        import ray

        ip = ray.util.get_node_ip_address()
        port_in = self._push.bind_to_random_port(f"tcp://{ip}")
        port_out = self._pull.bind_to_random_port(f"tcp://{ip}")
        return f"tcp://{ip}:{port_in}", f"tcp://{ip}:{port_out}"

    def _process(self, args: tuple) -> ActorProcess:
        args = (*args[:4], None, *args[5:])  # no parent process: Ray ends it with us

        def on_node(node_id: str, ip: str) -> None:
            self.node_id, self.node = node_id, ip

        return ActorProcess(args, self.options, self.name, on_node)
