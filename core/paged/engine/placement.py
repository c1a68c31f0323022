"""Where local replicas run: each one's share of this host's cores and devices (placements),
and whether a number of replicas fits the host at all (check_local_replicas)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from paged.config import EngineConfig

if TYPE_CHECKING:
    from paged.platform import Platform

log = logging.getLogger("paged")

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
    devices: str = ""  # what describe() shows of them: the mask and its slice

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
        devs = f"; {self.devices}" if self.devices else ""
        return f"replica {self.index}: cores {cpus}, {self.threads or 'default'} threads{devs}"


def usable_cpus() -> list[int]:
    """The cores this process may use (its affinity), else all of the host's."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return cpus or list(range(os.cpu_count() or 1))


def cores(n: int) -> list[Placement]:
    """n disjoint shares of this host's cores: those this process may use split evenly, each
    replica pinned to its own with as many threads (OMP_NUM_THREADS, when set, caps them);
    with fewer cores than replicas, none is pinned and each runs one thread. No devices yet
    (assign_devices)."""
    cpus = usable_cpus()
    k = len(cpus)
    cap = os.environ.get("OMP_NUM_THREADS", "")
    out = []
    for r in range(n):
        share = tuple(cpus[k * r // n : k * (r + 1) // n]) if k >= n else None  # else unpinned
        threads = len(share) if share else 1
        if cap.isdigit() and int(cap) > 0:
            threads = min(threads, int(cap))
        out.append(Placement(r, share, threads, {"OMP_NUM_THREADS": str(threads)}))
    return out


def visible_ids(platform: type[Platform]) -> list[str] | None:
    """The devices the platform's first set mask lists (empty: it hides them all); None when
    none of its masks is set (every device of the host)."""
    for var in platform.device_masks:
        seen = os.environ.get(var)
        if seen is not None:
            return [d.strip() for d in seen.split(",") if d.strip()]
    return None


def assign_devices(
    shares: list[Placement], platforms: list[type[Platform] | None], worlds: list[int]
) -> None:
    """Give replica i (shares[i], on platforms[i], world_size worlds[i]) the next worlds[i]
    devices of its platform's device type, in order of the visible ones, written to each of
    the platform's masks ("" when none is left: the replica fails its start-up). Platforms
    without masks (the CPU; None: unknown) get none and see what the server sees."""
    used: dict[str, int] = {}  # devices handed out so far, per device type
    ids: dict[type[Platform], list[str] | None] = {}
    for p, cls, w in zip(shares, platforms, worlds):
        if cls is None or not cls.device_masks:
            continue
        if cls not in ids:
            ids[cls] = visible_ids(cls)
        start = used.get(cls.device_type, 0)
        used[cls.device_type] = start + w
        seen = ids[cls]
        mine = ",".join(map(str, range(start, start + w) if seen is None else seen[start:][:w]))
        p.env.update({var: mine for var in cls.device_masks})
        p.devices = f"{cls.device_masks[0]}={mine}"


def placements(config: EngineConfig, n: int) -> list[Placement]:
    """n disjoint shares of this host for config's replicas: cores (cores) and config.world_size
    devices each of the platform the engine will select (assign_devices)."""
    from paged.plugins import platform_class

    shares = cores(n)
    assign_devices(shares, [platform_class(config.platform)] * n, [config.world_size] * n)
    return shares


def visible_devices(platform: type[Platform]) -> int | None:
    """How many devices of this platform the server's replicas can be given: those its mask
    lists, else what torch counts (None: unknown, or none found: the platform is then
    unavailable and its replicas fail the start-up)."""
    seen = visible_ids(platform)
    if seen is not None:
        return len(seen) or None
    try:
        import torch

        module = getattr(platform, "device_module", None) or platform.device_type
        count = getattr(torch, module).device_count()
    except Exception:  # no such backend in this torch, or it cannot count here
        return None
    return int(count) or None


def check_local_replicas(groups: list[tuple[str, type[Platform] | None, int, int]]) -> None:
    """Whether these replicas can all run on this host: groups of (platform name, its class or
    None when unknown, world_size, count). ValueError, saying why, for more replicas than
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
    need: dict[str, tuple[int, list[str], type[Platform]]] = {}
    for name, cls, world, count in groups:
        if cls is not None and cls.device_type != "cpu":
            n, names, _ = need.get(cls.device_type, (0, [], cls))
            need[cls.device_type] = (n + world * count, names + [name], cls)
    for device_type, (n, names, cls) in need.items():
        have = visible_devices(cls)
        if have is not None and n > have:
            raise ValueError(
                f"{n} {device_type} devices needed ({', '.join(dict.fromkeys(names))}: "
                f"replicas x tensor x pipeline parallel size), {have} visible on this host"
            )
