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

Failures, once the set has started: a replica whose engine dies, or stays silent longer than
`wedge_timeout` (the server's --health-timeout; it is then killed), leaves the rotation at
once and is restarted from its `factory` (a new engine-core process, or a new Ray actor,
with the same config and placement). A request it held that had produced nothing yet is sent
again to another replica (`retried`); one already streaming ends with EngineDeadError. After
MAX_RESTARTS failed starts in a row a replica stays dead; when every replica is, the set
fails as one engine does (every request fails, /health 503, the server exits 1). A replica
that fails its first start fails the start-up.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from paged.config import EngineConfig
from paged.engine.async_engine import AsyncEngine, EngineDeadError, ReplicaLostError, SeqUpdate
from paged.engine.placement import Placement, placements
from paged.engine.router import BLOCK, PrefixIndex, Router, block_hashes, fits, too_long
from paged.lora.request import LoRARequest
from paged.sampling.params import SamplingParams

log = logging.getLogger("paged")
EWMA = 0.3  # weight of a new speed sample
SPEED_WINDOW_S = 0.25  # shortest interval a throughput sample covers
MAX_RESTARTS = 3  # failed starts in a row before a replica is left dead
RESTART_BACKOFF_S = 1.0  # wait before the 2nd start in a row; doubles for each next one
STABLE_S = 60.0  # a replica up this long starts a new streak when it dies
START_TIMEOUT_S = 600.0  # for a restarted replica to be ready
# EngineCore.metrics() counters: a restarted replica's continue from its previous engine's.
COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "prompt_tokens", "generation_tokens",
            "num_preemptions", "late_launches", "late_launches_missed",
            "kernel_compiles")  # fmt: skip

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
    """One engine replica as the server sees it: an AsyncEngine (an engine core process on
    this host, or in a Ray actor: paged.engine.ray_replicas). `factory` builds a fresh one
    with the same config and placement when the replica is restarted."""

    def __init__(
        self,
        index: int,
        engine: AsyncEngine,
        placement: Placement | None = None,
        factory: Callable[[], AsyncEngine] | None = None,
    ):
        self.index = index
        self.engine = engine
        self.placement = placement
        self.factory = factory
        self.restarts = 0  # successful restarts
        self.restarting = False  # out of the rotation, a new engine on its way
        self.failed: str | None = None  # restarts gave up: why it stays dead
        self.streak = 0  # starts in a row since it last stayed up STABLE_S
        self.up_since: float | None = None
        self._carried: dict[str, float] = {}  # counters of the engines it replaced
        self._last_info: dict[str, Any] | None = None  # the replaced engine's
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
        """In the rotation: its engine serves and it is not being restarted."""
        return self.engine.ready and not self.restarting and self.failed is None

    @property
    def dead(self) -> str | None:
        return self.failed or self.engine.dead

    @property
    def health(self) -> str:
        """ready | starting | restarting | dead (for good, or not yet being restarted)."""
        if self.failed is not None:
            return "dead"
        if self.restarting:
            return "restarting"
        if self.engine.dead is not None:
            return "dead"
        return "ready" if self.engine.ready else "starting"

    @property
    def node(self) -> str:
        """Where its engine runs: this host's name, or the Ray node's address."""
        return getattr(self.engine, "node", None) or socket.gethostname()

    def replace_engine(self, engine: AsyncEngine) -> None:
        """Swap in a fresh engine (a restart): counters carry on from the old one; the prefix
        blocks tracked are forgotten (a new engine's cache is empty)."""
        old = self.engine
        for k in COUNTERS:
            if k in old.stats:
                self._carried[k] = self._carried.get(k, 0.0) + old.stats[k]
        self._last_info = old.info or self._last_info
        self.engine = engine
        self._prefix = None

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
        """The engine's latest metrics (EngineCore.metrics()); counters include those of the
        engines it replaced."""
        if not self._carried:
            return self.engine.stats
        s = dict(self.engine.stats)
        for k, v in self._carried.items():
            s[k] = s.get(k, 0.0) + v
        return s

    @property
    def info(self) -> dict[str, Any] | None:
        """The engine's Ready info (platform, dtype, max_model_len, num_blocks, pid, ...);
        while a new engine starts, the one it replaces."""
        return self.engine.info or self._last_info

    @property
    def platform(self) -> str:
        return (self.info or {}).get("platform") or "unknown"

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
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        lora_request: LoRARequest | None = None,
        user: str | None = None,
    ) -> AsyncIterator[SeqUpdate]:
        """The engine's generate (started now: its load rises at once), measured."""
        if self._mark is None or self.load == 0:
            self._mark, self._done = time.monotonic(), 0  # a busy interval starts
        updates = self.engine.generate(request_id, prompt_ids, params, lora_request, user)
        return self._measured(updates, prompt_ids)

    def unload_lora(self, lora_int_id: int) -> None:
        self.engine.unload_lora(lora_int_id)

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


async def _raising(e: BaseException) -> AsyncIterator[SeqUpdate]:
    """An iterator that raises `e` when iterated (a request refused before it was sent)."""
    raise e
    yield  # unreachable: makes this an async generator


def _ewma(old: float | None, sample: float) -> float:
    return sample if old is None else (1 - EWMA) * old + EWMA * sample


class ReplicaSet:
    """Several replicas behind one server, with AsyncEngine's server-facing surface."""

    def __init__(
        self,
        replicas: list[Replica],
        same_platform: bool = True,
        router: Router | str = "least-load",
        wedge_timeout: float = 5.0,
    ) -> None:
        """same_platform: refuse replicas that came up on different platforms (a data-parallel
        set is one kind of hardware: a replica that found no device of its own runs on the
        CPU fallback otherwise); False for a fleet file, whose groups name their platforms.
        router: a Router or a policy name (paged.engine.router.POLICIES). wedge_timeout: a
        serving replica silent this long is killed and restarted (--health-timeout)."""
        assert replicas, "a replica set needs replicas"
        self.replicas = replicas
        self.same_platform = same_platform
        self.router = router if isinstance(router, Router) else Router(router)
        self.wedge_timeout = wedge_timeout
        self.dead: str | None = None
        self.on_dead: Callable[[], None] | None = None
        self.retried = 0  # requests sent again after their replica died before a token
        self._observer: Any = None
        self._info: dict[str, Any] | None = None
        self._serving = False  # every replica came up: from now on, dead ones restart
        self._closing = False
        self._tasks: set[asyncio.Task] = set()  # restarts and the watchdog
        self._changed: asyncio.Event | None = None  # set when a replica's state changes
        for r in replicas:
            self._wire(r)

    def _wire(self, r: Replica) -> None:
        engine = r.engine
        engine.on_dead = lambda: self._replica_died(r, engine)
        engine.observer = self._observer
        engine.lost_uncounted = True  # _retrying counts a lost request that is not retried

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
        """Starting: every replica is ready. Serving: at least one is in the rotation."""
        if self.dead is not None:
            return False
        if self._serving:
            return any(r.ready for r in self.replicas)
        return all(r.ready for r in self.replicas)

    def silent_for(self) -> float:
        """Starting: the most silent replica's silence. Serving: the least silent serving
        replica's (a silent one is restarted by the watchdog; the others serve meanwhile)."""
        if not self._serving:
            return max(r.silent_for() for r in self.replicas)
        live = [r.silent_for() for r in self.replicas if r.ready]
        return min(live) if live else 0.0

    @property
    def info(self) -> dict[str, Any] | None:
        """The first replica's info with what all of them hold together: the smallest
        max_model_len (a request must fit wherever it goes; in a fleet, the largest of the
        replicas not dead for good: the router sends each request where it fits), the sum
        of KV blocks."""
        if self._info is None:
            infos = [r.info for r in self.replicas]
            if any(i is None for i in infos):
                return None
            info = dict(infos[0])
            lens = [i["max_model_len"] for r, i in zip(self.replicas, infos) if r.failed is None]
            lens = lens or [i["max_model_len"] for i in infos]
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
        """Wait until every replica is ready (True) or one is dead (False). From then on,
        replicas that die are restarted."""
        await asyncio.gather(*(r.wait_ready() for r in self.replicas))
        if self.ready and self.same_platform:
            kinds = [r.platform for r in self.replicas]
            if len(set(kinds)) > 1:
                self._fail_all(
                    f"the replicas run on different platforms ({', '.join(kinds)}): not enough "
                    f"devices for {len(kinds)} replicas of this engine"
                )
        if self.ready:
            now = time.monotonic()
            for r in self.replicas:
                r.up_since = now
                i = r.info or {}
                log.info(
                    "replica %d ready: pid %s on %s (%s), KV cache %d blocks",
                    r.index,
                    i.get("pid"),
                    i.get("platform"),
                    i.get("dtype"),
                    i.get("num_blocks", 0),
                )
            self._serving = True
            self._spawn(self._watchdog())
        return self.ready

    async def shutdown(self, timeout: float = 5.0) -> None:
        self._closing = True
        self._notify()  # requests waiting for a replica give up
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(r.shutdown(timeout) for r in self.replicas))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _notify(self) -> None:
        """Wake requests waiting for a replica to serve them."""
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def _replica_died(self, replica: Replica, engine: Any) -> None:
        if engine is not replica.engine or self._closing or self.dead is not None:
            return  # an engine already replaced, or the set is going anyway
        if not self._serving:  # a start-up failure fails the start-up
            self._fail_all(f"replica {replica.index}: {engine.dead}")
            return
        self._notify()
        if replica.factory is None:
            self._give_up(replica, engine.dead or "dead")
        elif not replica.restarting:
            log.error("replica %d is out of the rotation: %s", replica.index, engine.dead)
            replica.restarting = True
            self._spawn(self._restart(replica, engine.dead or "dead"))

    async def _restart(self, r: Replica, why: str) -> None:
        """New engines for the replica until one is ready: at most MAX_RESTARTS starts in a
        row (a replica that had stayed up STABLE_S starts a new streak), waiting
        RESTART_BACKOFF_S, then twice as long, ... between them."""
        platform = r.platform
        if r.up_since is not None and time.monotonic() - r.up_since >= STABLE_S:
            r.streak = 0
        r.up_since = None
        while r.streak < MAX_RESTARTS:
            if r.streak:
                await asyncio.sleep(RESTART_BACKOFF_S * 2 ** (r.streak - 1))
            r.streak += 1
            await r.shutdown(1.0)  # the old engine: kill it if it still runs
            assert r.factory is not None
            r.replace_engine(r.factory())
            self._wire(r)
            log.info("replica %d: restart %d in a row (%s)", r.index, r.streak, why)
            r.start()
            try:
                ok = await asyncio.wait_for(r.engine.wait_ready(), START_TIMEOUT_S)
            except TimeoutError:
                r.engine.fail(f"not ready within {START_TIMEOUT_S:g} s")
                ok = False
            if ok and r.engine.info and r.engine.info.get("platform") != platform:
                got = r.engine.info.get("platform")
                r.engine.fail(f"restarted on platform {got}, not {platform}")
                ok = False
            if ok:
                r.restarts += 1
                r.restarting, r.up_since = False, time.monotonic()
                self._info = None
                log.info("replica %d is back (restart %d): pid %s", r.index, r.restarts,
                         (r.info or {}).get("pid"))  # fmt: skip
                self._notify()
                return
            why = r.engine.dead or "not ready"
            log.error("replica %d: restart failed: %s", r.index, why)
        self._give_up(r, f"{MAX_RESTARTS} restarts in a row failed, the last: {why}")

    def _give_up(self, r: Replica, why: str) -> None:
        r.failed, r.restarting = why, False
        self._info = None  # the fleet's max_model_len: of the replicas that may still serve
        log.error("replica %d stays dead: %s", r.index, why)
        self._notify()
        if all(x.failed is not None for x in self.replicas):
            self._fail_all(f"every replica is dead; replica {r.index}: {why}")

    def _fail_all(self, reason: str) -> None:
        """Take the set down: fail every request on all replicas."""
        self.dead = reason
        for r in self.replicas:
            r.fail(reason)  # no-op for the one already dead
        self._notify()
        if self.on_dead is not None:
            self.on_dead()

    async def _watchdog(self) -> None:
        """Kill serving replicas silent for longer than wedge_timeout (then they restart)."""
        while not self._closing and self.dead is None:
            await asyncio.sleep(min(1.0, self.wedge_timeout / 4))
            for r in self.replicas:
                silent = r.silent_for()
                if r.ready and silent > self.wedge_timeout:
                    r.fail(f"silent for {silent:.1f} s (more than {self.wedge_timeout:g} s)")

    # ---- requests --------------------------------------------------------------------
    def route(
        self, prompt_ids: list[int], params: SamplingParams, hashes: list[int] | None = None
    ) -> Replica | None:
        """The router's pick among the serving replicas that can hold the request (their
        max_model_len at least its prompt plus max_tokens; router.py). None when some replica
        can hold it but none of those serves now (they are starting or restarting: wait for
        one, _serving_replica). When none can, not even one being restarted (those dead for
        good do not count), the 400 of router.too_long; EngineDeadError once the set is dead.
        A replica too small is never picked."""
        max_tokens = getattr(params, "max_tokens", None)
        n = len(prompt_ids)
        others = [r for r in self.replicas if r.failed is None]
        if self.dead is not None or not others:
            raise EngineDeadError(self.dead or "every replica is dead")
        able = [r for r in others if fits(r, n, max_tokens)]
        if not able:
            limit = max((r.info or {}).get("max_model_len") or 0 for r in others)
            raise too_long(n, max_tokens, limit)
        live = [r for r in able if r.ready]
        if not live:
            return None
        return self.router.pick(live, prompt_ids, max_tokens, hashes)

    def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        lora_request: LoRARequest | None = None,
        user: str | None = None,
    ) -> AsyncIterator[SeqUpdate]:
        """AsyncEngine.generate on the routed replica. Its load rises as soon as the iterator
        starts (the request is sent), before any other request is routed. The replica
        remembers the prompt's blocks (its prefix cache holds them next). If the replica dies
        before the request produced anything, it is sent again to another one. When the only
        replicas that can hold it are restarting, it waits for one of them (sent then); when
        none can, iterating raises the 400 of router.too_long."""
        hashes = block_hashes(prompt_ids)  # once: for the router and the replica's index
        try:
            replica = self.route(prompt_ids, params, hashes)
        except Exception as e:  # refused: raised to whoever iterates, as an engine does
            return _raising(e)
        first = None
        if replica is not None:
            replica.prefix.add(hashes)
            first = replica.generate(request_id, prompt_ids, params, lora_request, user)
        return self._retrying(request_id, prompt_ids, params, replica, first, lora_request, user)

    async def _retrying(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        replica: Replica | None,
        updates: AsyncIterator[SeqUpdate] | None,
        lora_request: LoRARequest | None = None,
        user: str | None = None,
    ) -> AsyncIterator[SeqUpdate]:
        """The updates of `updates` (None: no replica that can hold the request serves yet;
        wait for one, then send it there), sent again elsewhere when its replica dies before
        it produced anything."""
        attempts, produced, t0 = 1, False, time.monotonic()
        try:
            if updates is None:
                replica = await self._serving_replica(prompt_ids, params)
                replica.prefix.add(block_hashes(prompt_ids))
                updates = replica.generate(request_id, prompt_ids, params, lora_request, user)
            assert replica is not None
            while True:
                try:
                    async for u in updates:
                        produced = True
                        yield u
                    return
                except EngineDeadError as e:
                    if self.dead is None and not self._closing and produced:
                        raise ReplicaLostError(f"replica {replica.index}: {e}") from e
                    if produced or self._closing or attempts > len(self.replicas):
                        raise
                    lost = e
                finally:
                    await updates.aclose()  # type: ignore[attr-defined]
                try:
                    replica = await self._serving_replica(prompt_ids, params)
                except EngineDeadError:
                    raise
                except Exception:  # those that could hold it are dead for good: it is lost
                    raise ReplicaLostError(f"replica {replica.index}: {lost}; no other replica "
                                           "can hold this request") from None  # fmt: skip
                attempts += 1
                self.retried += 1
                log.warning("request %s: its replica died before it produced a token; sent "
                            "again to replica %d", request_id, replica.index)  # fmt: skip
                replica.prefix.add(block_hashes(prompt_ids))
                updates = replica.generate(request_id, prompt_ids, params, lora_request, user)
        except EngineDeadError:
            if not produced and self._observer is not None:  # its engines did not count it
                for _ in range(params.num_sequences):
                    self._observer.finished("error", time.monotonic() - t0)
            raise

    async def _serving_replica(self, prompt_ids: list[int], params: SamplingParams) -> Replica:
        """The router's pick among the serving replicas that can hold the request, waiting
        while none of those serves (they are restarting); EngineDeadError once the set is
        dead, the 400 of router.too_long once every replica that could hold it is dead for
        good."""
        while True:
            if self.dead is not None or self._closing:
                raise EngineDeadError(self.dead or "the server is shutting down")
            replica = self.route(prompt_ids, params)
            if replica is not None:
                return replica
            if self._changed is None:
                self._changed = asyncio.Event()
            await self._changed.wait()

    def abort(self, request_id: str) -> None:
        for r in self.replicas:
            r.abort(request_id)

    def unload_lora(self, lora_int_id: int) -> None:
        for r in self.replicas:
            r.unload_lora(lora_int_id)


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

        def factory(p: Placement = p) -> AsyncEngine:
            return AsyncEngine(
                one, log_level, load, faults, placement=p, name=f"paged-core-{p.index}"
            )

        replicas.append(Replica(p.index, factory(), p, factory))
    log.info("data parallel: %d replicas (%s)", n, ". ".join(p.describe() for p in shares))
    return ReplicaSet(replicas, router=router)


def fleet_view(engine: AsyncEngine | ReplicaSet) -> dict[str, Any]:
    """What GET /fleet answers: each replica's platform, node, pid, health, restarts, load, KV
    usage, measured speeds and prefix blocks tracked; the router's policy and the requests
    sent again after their replica died (a single engine: one row)."""
    if isinstance(engine, ReplicaSet):
        replicas, policy, retried = engine.replicas, engine.router.policy, engine.retried
    else:
        replicas, policy, retried = [Replica(0, engine)], None, 0
    rows = []
    for r in replicas:
        i, s = r.info or {}, r.stats
        rows.append(
            {
                "index": r.index,
                "platform": i.get("platform"),
                "node": r.node,
                "node_id": getattr(r.engine, "node_id", None),
                "pid": i.get("pid"),
                "health": r.health,
                "restarts": r.restarts,
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
    return {"router": policy, "retried_requests": retried, "replicas": rows}
