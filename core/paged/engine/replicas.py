"""Engine replicas behind one server (`--data-parallel-size N`).

`Replica` is what the server sees of one engine: its AsyncEngine, health (ready, dead,
silent_for), load (outstanding work, tracked from what was sent and what came back), stats
(the engine's metrics) and info (platform, max_model_len, ...). `ReplicaSet` has the surface
the server uses of an AsyncEngine (generate, abort, ready, dead, tokenizer, info, stats, ...)
and routes each request with a policy of paged.engine.router (least outstanding work, round
robin, or the prefix-aware default of `paged serve`). Replicas of a fleet file
(paged.engine.fleet) may run on different platforms; data-parallel replicas may not.

Each replica here is an engine core process on this host with its share of it (`Placement`:
CPU cores and threads, devices), applied first thing in that process. Replicas on other
hosts or hardware implement the same `Replica` surface; `ReplicaSet.route` is the policy.

With one replica the server uses the AsyncEngine itself (`make_engine`): no overhead.
A replica that dies is fatal, as one engine's death is: every request in flight on any
replica fails, /health turns 503 and the server exits 1.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from paged.config import EngineConfig
from paged.engine.async_engine import AsyncEngine, SeqUpdate
from paged.engine.router import BLOCK, PrefixIndex, Router, block_hashes
from paged.sampling.params import SamplingParams

log = logging.getLogger("paged")
EWMA = 0.3  # weight of a new speed sample
SPEED_WINDOW_S = 0.25  # shortest interval a throughput sample covers

# Variables that choose the devices a process sees, by platform family: each replica sees a
# disjoint slice of what the server sees (CUDA_VISIBLE_DEVICES also filters HIP devices).
DEVICE_VARS = ("CUDA_VISIBLE_DEVICES", "ZE_AFFINITY_MASK")


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


def placements(config: EngineConfig, n: int) -> list[Placement]:
    """n disjoint shares of this host: the cores this process may use split evenly (each
    replica pinned to its own, with as many threads; OMP_NUM_THREADS, when set, caps the
    threads), and config.world_size devices each, in order of the visible ones."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    cpus = cpus or list(range(os.cpu_count() or 1))
    k = len(cpus)
    cap = os.environ.get("OMP_NUM_THREADS", "")
    world = config.world_size
    out = []
    for r in range(n):
        share = tuple(cpus[k * r // n : k * (r + 1) // n]) if k >= n else None  # else unpinned
        threads = len(share) if share else 1
        if cap.isdigit() and int(cap) > 0:
            threads = min(threads, int(cap))
        env = {"OMP_NUM_THREADS": str(threads)}
        for var in DEVICE_VARS:
            seen = os.environ.get(var)
            ids = seen.split(",") if seen else [str(i) for i in range(n * world)]
            env[var] = ",".join(ids[r * world : (r + 1) * world])  # "": no device left
        out.append(Placement(r, share, threads, env))
    return out


def _load_once(load: Callable[[], Any] | None) -> Callable[[], Any] | None:
    """One tokenizer for every replica: the first caller loads it, the others wait for it."""
    if load is None:
        return None
    lock, box = threading.Lock(), []

    def once() -> Any:
        with lock:
            if not box:
                box.append(load())
            return box[0]

    return once


class Replica:
    """One engine replica as the server sees it: here an AsyncEngine (an engine core
    process on this host)."""

    def __init__(self, index: int, engine: AsyncEngine, placement: Placement | None = None):
        self.index = index
        self.engine = engine
        self.placement = placement
        # Learnt from the outputs it returns (tokens/s EWMAs; None until measured): its
        # throughput while busy (prompt and generated tokens), and prompt tokens per second of
        # time to first token. The router divides outstanding work by the first and weighs
        # cached prefixes by the second.
        self.speed: float | None = None
        self.prefill_speed: float | None = None
        self._done = 0  # tokens done since _mark
        self._mark: float | None = None  # start of the current busy interval
        self._prefix: PrefixIndex | None = None

    @property
    def prefix(self) -> PrefixIndex:
        """The chained block hashes of prompts sent to it, at most its KV blocks' worth."""
        if self._prefix is None:
            i = self.info or {}
            cap = i.get("num_blocks", 0) * (i.get("block_size") or BLOCK) // BLOCK
            if not i:
                return PrefixIndex(0)  # not ready: nothing tracked yet
            self._prefix = PrefixIndex(cap)
        return self._prefix

    # ---- health ----------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.engine.ready

    @property
    def dead(self) -> str | None:
        return self.engine.dead

    def silent_for(self) -> float:
        return self.engine.silent_for()

    # ---- what it holds and does --------------------------------------------------------
    @property
    def load(self) -> int:
        """Outstanding work in tokens: prompt tokens not yet computed plus tokens still to
        generate of every sequence sent to it."""
        return self.engine.outstanding_tokens

    @property
    def stats(self) -> dict[str, float]:
        """The engine's latest metrics (EngineCore.metrics())."""
        return self.engine.stats

    @property
    def info(self) -> dict[str, Any] | None:
        """The engine's Ready info (platform, dtype, max_model_len, num_blocks, pid, ...)."""
        return self.engine.info

    @property
    def platform(self) -> str:
        return (self.engine.info or {}).get("platform") or "unknown"

    # ---- lifecycle and requests --------------------------------------------------------
    def start(self) -> None:
        self.engine.start()

    async def wait_ready(self) -> bool:
        return await self.engine.wait_ready()

    async def shutdown(self, timeout: float = 5.0) -> None:
        await self.engine.shutdown(timeout)

    def fail(self, reason: str) -> None:
        self.engine.fail(reason)

    def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[SeqUpdate]:
        """The engine's generate (started now: its load rises at once), measured."""
        if self._mark is None or self.load == 0:
            self._mark, self._done = time.monotonic(), 0  # a busy interval starts
        return self._measured(self.engine.generate(request_id, prompt_ids, params), prompt_ids)

    async def _measured(
        self, updates: AsyncIterator[SeqUpdate], prompt_ids: list[int]
    ) -> AsyncIterator[SeqUpdate]:
        t0, first = time.monotonic(), True
        try:
            async for u in updates:
                k = len(u.output.new_token_ids)
                now = time.monotonic()
                if first and k:
                    first = False
                    k += len(prompt_ids)
                    rate = len(prompt_ids) / max(now - t0, 1e-3)
                    self.prefill_speed = _ewma(self.prefill_speed, rate)
                self._observe(k, now)
                yield u
        finally:  # closed early (the client went away): the engine aborts it now
            await updates.aclose()

    def _observe(self, tokens: int, now: float) -> None:
        """Tokens done; every SPEED_WINDOW_S of busy time, a throughput sample."""
        self._done += tokens
        mark = self._mark if self._mark is not None else now
        if now - mark >= SPEED_WINDOW_S and self._done:
            self.speed = _ewma(self.speed, self._done / (now - mark))
            self._mark, self._done = now, 0

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)


def _ewma(old: float | None, sample: float) -> float:
    return sample if old is None else (1 - EWMA) * old + EWMA * sample


class ReplicaSet:
    """Several replicas behind one server, with AsyncEngine's server-facing surface."""

    def __init__(
        self,
        replicas: list[Replica],
        same_platform: bool = True,
        router: Router | str = "least-load",
    ) -> None:
        """same_platform: refuse replicas that came up on different platforms (a data-parallel
        set is one kind of hardware: a replica that found no device of its own runs on the
        CPU fallback otherwise); False for a fleet file, whose groups name their platforms.
        router: a Router or a policy name (paged.engine.router.POLICIES)."""
        assert replicas, "a replica set needs replicas"
        self.replicas = replicas
        self.same_platform = same_platform
        self.router = router if isinstance(router, Router) else Router(router)
        self.dead: str | None = None
        self.on_dead: Callable[[], None] | None = None
        self._observer: Any = None
        self._info: dict[str, Any] | None = None
        for r in replicas:
            r.engine.on_dead = lambda r=r: self._replica_died(r)

    # ---- what the server reads -------------------------------------------------------
    @property
    def observer(self) -> Any:
        return self._observer

    @observer.setter
    def observer(self, obs: Any) -> None:
        self._observer = obs
        for r in self.replicas:
            r.engine.observer = obs

    @property
    def tokenizer(self) -> Any:
        return self.replicas[0].engine.tokenizer

    @property
    def ready(self) -> bool:
        return self.dead is None and all(r.ready for r in self.replicas)

    def silent_for(self) -> float:
        """The most silent replica's silence: one wedged replica makes /health fail."""
        return max(r.silent_for() for r in self.replicas)

    @property
    def info(self) -> dict[str, Any] | None:
        """The first replica's info with what all of them hold together: the smallest
        max_model_len (a request must fit wherever it goes; in a fleet, the largest: the
        router sends each request where it fits), the sum of KV blocks."""
        if self._info is None:
            infos = [r.info for r in self.replicas]
            if any(i is None for i in infos):
                return None
            info = dict(infos[0])
            lens = [i["max_model_len"] for i in infos]
            info["max_model_len"] = min(lens) if self.same_platform else max(lens)
            info["platforms"] = [i.get("platform") for i in infos]
            info["num_blocks"] = sum(i["num_blocks"] for i in infos)
            info["pids"] = [i["pid"] for i in infos]
            info["data_parallel_size"] = len(infos)
            self._info = info
        return self._info

    @property
    def stats(self) -> dict[str, float]:
        """The replicas' metrics summed; KV usage over all their blocks."""
        total: dict[str, float] = {}
        used = 0.0
        for r in self.replicas:
            s = r.stats
            for k, v in s.items():
                total[k] = total.get(k, 0) + v
            used += s.get("kv_cache_usage_perc", 0.0) * s.get("num_blocks", 0)
        if total.get("num_blocks"):
            total["kv_cache_usage_perc"] = used / total["num_blocks"]
        return total

    # ---- lifecycle -------------------------------------------------------------------
    def start(self) -> None:
        for r in self.replicas:
            r.start()

    async def wait_ready(self) -> bool:
        """Wait until every replica is ready (True) or one is dead (False)."""
        await asyncio.gather(*(r.wait_ready() for r in self.replicas))
        if self.ready and self.same_platform:
            kinds = [r.platform for r in self.replicas]
            if len(set(kinds)) > 1:
                self._fail_all(
                    f"the replicas run on different platforms ({', '.join(kinds)}): not enough "
                    f"devices for {len(kinds)} replicas of this engine"
                )
        if self.ready:
            for r in self.replicas:
                i = r.info or {}
                log.info(
                    "replica %d ready: pid %s on %s (%s), KV cache %d blocks",
                    r.index,
                    i.get("pid"),
                    i.get("platform"),
                    i.get("dtype"),
                    i.get("num_blocks", 0),
                )
        return self.ready

    async def shutdown(self, timeout: float = 5.0) -> None:
        await asyncio.gather(*(r.shutdown(timeout) for r in self.replicas))

    def _replica_died(self, replica: Replica) -> None:
        if self.dead is None:
            self._fail_all(f"replica {replica.index}: {replica.dead}")

    def _fail_all(self, reason: str) -> None:
        """One replica down takes the set down: fail every request on all of them."""
        self.dead = reason
        for r in self.replicas:
            r.fail(reason)  # no-op for the one already dead
        if self.on_dead is not None:
            self.on_dead()

    # ---- requests --------------------------------------------------------------------
    def route(self, prompt_ids: list[int], params: SamplingParams) -> Replica:
        """The router's pick among the replicas that can hold the request (router.py)."""
        max_tokens = getattr(params, "max_tokens", None)
        return self.router.pick(self.replicas, prompt_ids, max_tokens)

    def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[SeqUpdate]:
        """AsyncEngine.generate on the routed replica. Its load rises as soon as the iterator
        starts (the request is sent), before any other request is routed. The replica
        remembers the prompt's blocks (its prefix cache holds them next)."""
        replica = self.route(prompt_ids, params)
        replica.prefix.add(block_hashes(prompt_ids))
        return replica.generate(request_id, prompt_ids, params)

    def abort(self, request_id: str) -> None:
        for r in self.replicas:
            r.abort(request_id)


def make_engine(
    config: EngineConfig,
    log_level: str = "info",
    tokenizer_loader: Callable[[], Any] | None = None,
    faults: Any = None,
    router: str = "least-load",
) -> AsyncEngine | ReplicaSet:
    """The server's engine: one AsyncEngine, or config.data_parallel_size replicas routed by
    `router` (a policy of paged.engine.router)."""
    n = config.data_parallel_size
    if n == 1:
        return AsyncEngine(config, log_level, tokenizer_loader, faults)
    load = _load_once(tokenizer_loader)
    replicas = []
    shares = placements(config, n)
    one = dataclasses.replace(config, data_parallel_size=1)  # what each replica runs
    for p in shares:
        name = f"paged-core-{p.index}"
        engine = AsyncEngine(one, log_level, load, faults, placement=p, name=name)
        replicas.append(Replica(p.index, engine, p))
    log.info("data parallel: %d replicas (%s)", n, ". ".join(p.describe() for p in shares))
    return ReplicaSet(replicas, router=router)


def fleet_view(engine: AsyncEngine | ReplicaSet) -> dict[str, Any]:
    """What GET /fleet answers: each replica's platform, pid, health, load, KV usage, measured
    speeds and prefix blocks tracked, and the router's policy (a single engine: one row)."""
    if isinstance(engine, ReplicaSet):
        replicas, policy = engine.replicas, engine.router.policy
    else:
        replicas, policy = [Replica(0, engine)], None
    rows = []
    for r in replicas:
        i, s = r.info or {}, r.stats
        health = "dead" if r.dead is not None else ("ready" if r.ready else "starting")
        rows.append(
            {
                "index": r.index,
                "platform": i.get("platform"),
                "pid": i.get("pid"),
                "health": health,
                "dead": r.dead,
                "silent_for": round(r.silent_for(), 3),
                "outstanding_tokens": r.load,
                "kv_cache_usage_perc": s.get("kv_cache_usage_perc", 0.0),
                "num_blocks": i.get("num_blocks"),
                "max_model_len": i.get("max_model_len"),
                "running": s.get("num_requests_running", 0),
                "waiting": s.get("num_requests_waiting", 0),
                "prompt_tokens": s.get("prompt_tokens", 0),
                "speed_tokens_per_s": r.speed,
                "prefill_tokens_per_s": r.prefill_speed,
                "prefix_blocks": len(r.prefix) if r._prefix is not None else 0,
            }
        )
    return {"router": policy, "replicas": rows}
