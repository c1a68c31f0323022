"""Where local replicas run: each one's share of this host's cores and devices (placements),
and whether a number of replicas fits the host at all (check_local_replicas)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from paged.config import EngineConfig

log = logging.getLogger("paged")

# Variables that choose the devices a process sees, by platform family: each replica sees a
# disjoint slice of what the server sees (CUDA_VISIBLE_DEVICES also filters HIP devices).
DEVICE_VARS = ("CUDA_VISIBLE_DEVICES", "ZE_AFFINITY_MASK")
# Most replicas on this host per core this server may use. Past one per core they run unpinned
# with one thread each (placements); every one is a process with its own engine loop, weights
# and KV cache, so many more than the cores mostly wait for one (and a count by the thousand
# would exhaust the host before serving anything). check_local_replicas refuses more.
REPLICAS_PER_CORE = 4


@dataclass
class Placement:
    """A replica's share of the host, applied in its core process before the engine starts."""

    index: int
    cpus: tuple[int, ...] | None = None  # pin the process to these cores
    threads: int | None = None  # torch (and OpenMP) threads
    env: dict[str, str] = field(default_factory=dict)  # e.g. the devices it sees

    def apply(self) -> None:
        os.environ.update(self.env)
        if self.cpus and hasattr(os, "sched_setaffinity"):
            try:
                os.sched_setaffinity(0, self.cpus)
            except OSError as e:  # a cpuset that changed under us: run unpinned
                log.warning("replica %d: cannot pin to cores %s: %s", self.index, self.cpus, e)
        if self.threads:
            import torch

            torch.set_num_threads(self.threads)
        log.debug("%s", self.describe())

    def describe(self) -> str:
        cpus = "[" + ",".join(map(str, self.cpus)) + "]" if self.cpus else "any"
        devs = "".join(f" {k}={v}" for k, v in self.env.items() if k in DEVICE_VARS)
        return f"replica {self.index}: cores {cpus}, {self.threads or 'default'} threads;{devs}"


def usable_cpus() -> list[int]:
    """The cores this process may use (its affinity), else all of the host's."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return cpus or list(range(os.cpu_count() or 1))


def placements(config: EngineConfig, n: int) -> list[Placement]:
    """n disjoint shares of this host: the cores this process may use split evenly (each
    replica pinned to its own, with as many threads; OMP_NUM_THREADS, when set, caps the
    threads), and config.world_size devices each, in order of the visible ones."""
    cpus = usable_cpus()
    k = len(cpus)
    cap = os.environ.get("OMP_NUM_THREADS", "")
    world = config.world_size
    visible = {var: os.environ.get(var) for var in DEVICE_VARS}
    ids = {var: seen.split(",") if seen else None for var, seen in visible.items()}
    out = []
    for r in range(n):
        share = tuple(cpus[k * r // n : k * (r + 1) // n]) if k >= n else None  # else unpinned
        threads = len(share) if share else 1
        if cap.isdigit() and int(cap) > 0:
            threads = min(threads, int(cap))
        env = {"OMP_NUM_THREADS": str(threads)}
        for var in DEVICE_VARS:
            seen = ids[var]  # "": no device left
            mine = range(r * world, (r + 1) * world) if seen is None else seen[r * world :][:world]
            env[var] = ",".join(map(str, mine))
        out.append(Placement(r, share, threads, env))
    return out


def visible_devices(device_type: str) -> int | None:
    """How many devices of this type the server's replicas can be given: those its
    CUDA_VISIBLE_DEVICES / ZE_AFFINITY_MASK name, else what torch counts (None: unknown, or
    none found: the platform is then unavailable and its replicas fail the start-up)."""
    var = {"cuda": "CUDA_VISIBLE_DEVICES", "xpu": "ZE_AFFINITY_MASK"}.get(device_type)
    seen = os.environ.get(var) if var else None
    if seen is not None:
        return len([d for d in seen.split(",") if d.strip()]) or None
    try:
        import torch

        count = getattr(torch, device_type).device_count()
    except Exception:  # no such backend in this torch, or it cannot count here
        return None
    return int(count) or None


def check_local_replicas(groups: list[tuple[str | None, str, int, int]]) -> None:
    """Whether these replicas can all run on this host: groups of (platform or None,
    device_type, world_size, count). ValueError, saying why, for more replicas than
    REPLICAS_PER_CORE per core this server may use, or, for a device platform, more devices
    (count x world_size over its groups) than this host shows."""
    k = len(usable_cpus())
    total = sum(c for *_, c in groups)
    if total > REPLICAS_PER_CORE * k:
        raise ValueError(
            f"{total} replicas on this host, more than it can run: at most "
            f"{REPLICAS_PER_CORE * k} ({REPLICAS_PER_CORE} per core, {k} cores this server "
            "may use)"
        )
    need: dict[str, tuple[int, list[str]]] = {}
    for platform, device_type, world, count in groups:
        if device_type != "cpu":
            n, names = need.get(device_type, (0, []))
            need[device_type] = (n + world * count, names + [platform or device_type])
    for device_type, (n, names) in need.items():
        have = visible_devices(device_type)
        if have is not None and n > have:
            raise ValueError(
                f"{n} {device_type} devices needed ({', '.join(dict.fromkeys(names))}: "
                f"replicas x tensor x pipeline parallel size), {have} visible on this host"
            )
