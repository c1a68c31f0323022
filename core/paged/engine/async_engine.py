"""AsyncEngine: the EngineCore in its own process, driven from an asyncio server.

The core process steps whenever it has work; the server process tokenizes, detokenizes
(OutputState) and streams. Two ZMQ ipc sockets carry typed messages (paged.engine.messages,
msgpack-encoded; one encoder and one decoder per direction):
    server -> core   Add([NewRequest(id, prompt_ids, params), ...]) | Abort([ids]) | Shutdown()
    core -> server   Ready(info) | Error(message) | Outputs(outputs, stats, queue_times) | Alive()
One Outputs per step batches its outputs with EngineCore.metrics(); Alive is the heartbeat.
If the core dies, every in-flight request fails with EngineDeadError and `on_dead` fires (the
server exits 1). Several AsyncEngines behind one server: paged.engine.replicas.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq.asyncio

from paged.config import EngineConfig
from paged.engine import messages as m
from paged.engine.faults import Faults
from paged.engine.gc_pauses import freeze_startup_objects
from paged.engine.messages import REJECTED, EngineOutput
from paged.engine.outputs import OutputState
from paged.engine.request import sample_params, sequence_ids
from paged.logs import configure_logging
from paged.lora.request import LoRARequest
from paged.sampling.params import SamplingParams

log = logging.getLogger("paged")
HEARTBEAT_S = 1.0  # the core process says it is alive this often


class EngineDeadError(RuntimeError):
    """The engine core process is gone."""


class ReplicaLostError(EngineDeadError):
    """The replica running a request is gone (mid-stream); the others still serve."""


class EngineStepError(RuntimeError):
    """An engine step failed for this request; the engine itself still serves."""


# ---- the core process ------------------------------------------------------------------
def _die_with_parent(parent: int) -> None:
    """Ask the kernel to kill this process when the server process ends, however it ends
    (Linux; elsewhere the loop's parent check does it), and exit now if it already has."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        raise SystemExit(1)


def _core_main(
    config: EngineConfig,
    addr_in: str,
    addr_out: str,
    log_level: str,
    parent: int | None,
    faults: Faults | None = None,
    placement: Any = None,
) -> None:
    """placement: None, or an object whose apply() runs first (a replica's share of the
    host: paged.engine.placement.Placement). parent: the server's pid, or None in a Ray actor
    (which Ray ends with its owner, the server: paged.engine.ray_replicas)."""
    configure_logging(log_level)
    if parent is not None:
        # The server's to handle: it drains, then stops us.
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        _die_with_parent(parent)
    if placement is not None:
        placement.apply()
    ctx = zmq.Context()
    ctx.setsockopt(zmq.SNDHWM, 0)  # outputs queue here, never block the step loop
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.connect(addr_in)
    push.connect(addr_out)
    encode = m.encoder().encode

    def send(msg: m.FromEngine) -> None:
        try:
            push.send(encode(msg), zmq.NOBLOCK)
        except zmq.Again:  # no server to take it: the parent check ends the loop
            pass

    try:
        from paged.engine.core import EngineCore

        core = EngineCore(config, faults, exit_on_failure=True)
    except Exception as e:  # a clear start-up error, then exit non-zero
        log.exception("engine start-up failed")
        send(m.Error(f"{type(e).__name__}: {e}"))
        push.close(linger=2000)
        raise SystemExit(1) from None
    name = core.source.name if core.source is not None else config.model
    info = m.EngineInfo(
        max_model_len=core.max_model_len,
        vocab_size=core.vocab_size,
        model_name=name,
        num_blocks=core.num_blocks,
        block_size=config.block_size,
        pid=os.getpid(),
        platform=core.platform.name,
        dtype=core.config.dtype,
        eos_token_ids=list(core.eos_token_ids),
    )
    freeze_startup_objects()  # the model's objects: out of the collector's scans
    send(m.Ready(info))
    stop = threading.Event()
    beat = threading.Thread(target=_heartbeat, args=(ctx, addr_out, stop), daemon=True)
    beat.start()
    try:
        _core_loop(core, pull, send, parent)
    finally:
        stop.set()
        beat.join(2)
        core.shutdown()
        push.close(linger=1000)
        pull.close(linger=0)


def _heartbeat(ctx: zmq.Context, addr_out: str, stop: threading.Event) -> None:
    """Tell the server every HEARTBEAT_S that this process runs (its /health turns 503 when
    the beats stop: the process is stopped, swapped out or wedged)."""
    sock = ctx.socket(zmq.PUSH)
    sock.connect(addr_out)
    msg = m.encoder().encode(m.Alive())
    while not stop.wait(HEARTBEAT_S):
        try:
            sock.send(msg, zmq.NOBLOCK)
        except zmq.Again:
            pass
    sock.close(linger=0)


def _core_loop(
    core: Any, pull: zmq.Socket, send: Callable[[m.FromEngine], None], parent: int | None
) -> None:
    from paged.engine.request import Status

    decode = m.to_engine_decoder().decode
    arrivals: dict[str, float] = {}  # requests not yet scheduled -> arrival time
    while True:
        if parent is not None and os.getppid() != parent:  # the server is gone: no reader
            log.error("the server process is gone; the engine core exits")
            return
        rejected: list[EngineOutput] = []  # idle: block (1 s at a time, to notice orphaning)
        timeout, got = (0 if core.has_unfinished() else 1000), False
        due = core.launch_deadline() if timeout == 0 else None  # late launch: take requests
        if due is not None:  # until shortly before the step in flight ends
            timeout = _ms_until(due)
        while pull.poll(timeout):
            msg = decode(pull.recv(copy=False).buffer)
            if type(msg) is m.Add:
                for r in msg.requests:
                    rid = r.request_id
                    try:
                        core.add_request(rid, r.prompt_token_ids, r.params, r.lora)
                        arrivals[rid] = time.time()
                    except ValueError as e:  # each of its sequences is told
                        for sid in sequence_ids(rid, r.params.num_sequences):
                            rejected.append(EngineOutput(sid, [], True, REJECTED, error=str(e)))
            elif type(msg) is m.Abort:
                core.abort(msg.request_ids)
            elif type(msg) is m.UnloadLora:
                core.remove_lora(msg.lora_int_id)
            elif type(msg) is m.Shutdown:
                return
            timeout, got = (0 if due is None else _ms_until(due)), True
        if not core.has_unfinished():
            if got:  # report aborts and rejections even without a step
                send(m.Outputs(rejected, core.metrics(), {}))
            continue
        t = time.time()
        outs = core.step()
        queue_times: dict[str, float] = {}
        done = {eo.request_id for eo in outs}
        for rid, t0 in list(arrivals.items()):  # first scheduled in this step: queue time
            req = core.requests.get(rid)
            if req is None or req.status is not Status.WAITING:
                del arrivals[rid]
                if req is not None or rid in done:
                    queue_times[rid] = t - t0
        send(m.Outputs(rejected + outs, core.metrics(), queue_times))


def _ms_until(due: float) -> int:
    """Whole milliseconds from now until `due` (time.perf_counter), at least 0: a poll
    timeout that ends at or before it."""
    return max(0, int((due - time.perf_counter()) * 1e3))


# ---- the server side -------------------------------------------------------------------
@dataclass
class RequestRecord:
    """A request that ended (finished, aborted or failed), for the observer's request_done:
    the request log, the per-request metrics and its trace span. Times in seconds from its
    arrival at this engine; None/0.0 when it never got there (no token, never scheduled)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    states: list[OutputState]  # one per sequence: .out.text, .out.token_ids
    finish_reasons: list[str]  # one per sequence
    arrival: float  # time.time() when it arrived
    e2e: float
    queue_time: float | None  # waiting in the core before it was first scheduled
    first_token: float  # 0.0: none came
    last_token: float
    cached_tokens: int  # prompt tokens found in the prefix cache
    user: str | None = None  # the end user the client named (OpenAI's `user`)

    @property
    def output_tokens(self) -> int:
        return sum(len(s.out.token_ids) for s in self.states)


@dataclass
class SeqUpdate:
    """One engine output applied to one sequence of a request (index in 0..n-1)."""

    index: int
    state: OutputState
    output: EngineOutput


class AsyncEngine:
    def __init__(
        self,
        config: EngineConfig,
        log_level: str = "info",
        tokenizer_loader=None,
        faults: Faults | None = None,
        placement: Any = None,
        name: str = "paged-core",
    ):
        """tokenizer_loader: a function run in a thread while the core starts; faults: test-only
        fault injection for the core (paged.engine.faults); placement: run first in the core
        process (a replica's share of the host, paged.engine.replicas); name: the process's."""
        self.config = config
        self.faults = faults
        self.placement = placement
        self.name = name
        self.tokenizer: Any = None
        self._load_tokenizer: Callable[[], Any] | None = tokenizer_loader
        self.log_level = log_level
        self.info: dict[str, Any] | None = None  # the core's "ready" message
        self.stats: dict[str, float] = {}  # latest EngineCore.metrics()
        self.dead: str | None = None  # why the core is gone
        self.observer: Any = None  # metrics hooks (server.metrics.ServerMetrics)
        self.on_dead: Callable[[], None] | None = None
        # Set by a replica set, which sends a request lost before any output to another
        # replica and counts it itself if it fails: such a loss is not counted here.
        self.lost_uncounted = False
        self._seqs: dict[str, tuple[asyncio.Queue, int]] = {}
        self._children: dict[str, list[str]] = {}
        self._queued: dict[str, float] = {}  # request id -> its queue time in the core
        self._settled = asyncio.Event()  # ready (core and tokenizer) or dead
        self._proc: Any = None
        self._dir = ""  # of the ipc sockets
        self._closing = False
        self.last_heard = time.monotonic()  # the core's last message (output or heartbeat)
        # Outstanding work, from what was sent and what came back: prompt tokens not yet
        # computed plus tokens still to generate (max_tokens) of every sequence in flight.
        self.outstanding_tokens = 0
        self._encode = m.encoder().encode
        self._decode = m.from_engine_decoder().decode

    # ---- lifecycle -----------------------------------------------------------------
    def start(self) -> None:
        self._ctxs = (zmq.Context(), zmq.asyncio.Context())
        for ctx in self._ctxs:  # unbounded queues: a send never blocks the event loop
            ctx.setsockopt(zmq.SNDHWM, 0)
            ctx.setsockopt(zmq.RCVHWM, 0)
        self._push, self._pull = self._ctxs[0].socket(zmq.PUSH), self._ctxs[1].socket(zmq.PULL)
        addr_in, addr_out = self._bind()
        args = (self.config, addr_in, addr_out, self.log_level, os.getpid(), self.faults)
        args += (self.placement,)
        self._proc = self._process(args)
        self._proc.start()
        loop = asyncio.get_running_loop()
        loop.add_reader(self._proc.sentinel, self._on_exit)
        self._reader = loop.create_task(self._read_loop())
        self._tok_task = loop.create_task(self._tokenizer())

    def _bind(self) -> tuple[str, str]:
        """Bind the sockets to the core (in) and from it (out); their addresses."""
        self._dir = tempfile.mkdtemp(prefix="paged-")
        addr_in, addr_out = f"ipc://{self._dir}/in", f"ipc://{self._dir}/out"
        self._push.bind(addr_in)
        self._pull.bind(addr_out)
        return addr_in, addr_out

    def _process(self, args: tuple) -> Any:
        """The core's process, not started: here a local one; anything with the start,
        sentinel, is_alive, join, kill and exitcode of multiprocessing.Process will do."""
        mp = multiprocessing.get_context("spawn")
        # Not a daemon: it starts worker processes of its own (tensor/pipeline parallel).
        return mp.Process(target=_core_main, args=args, name=self.name, daemon=False)

    async def _tokenizer(self) -> None:
        try:
            if self._load_tokenizer is not None:
                self.tokenizer = await asyncio.to_thread(self._load_tokenizer)
            self._load_tokenizer = None
            self._settle()
        except Exception as e:
            self._die(f"cannot load the tokenizer: {e}")

    def _settle(self) -> None:
        if self.info is not None and self._load_tokenizer is None:
            self._settled.set()

    @property
    def ready(self) -> bool:
        return self._settled.is_set() and self.dead is None

    async def wait_ready(self) -> bool:
        """Wait until the engine is ready (True) or dead (False)."""
        await self._settled.wait()
        return self.ready

    async def shutdown(self, timeout: float = 5.0) -> None:
        self._closing = True
        if self._proc is None:
            return
        asyncio.get_running_loop().remove_reader(self._proc.sentinel)
        if self._proc.is_alive():
            self._send(m.Shutdown())
            await asyncio.to_thread(self._proc.join, timeout)
        if self._proc.is_alive():
            self._proc.kill()
            await asyncio.to_thread(self._proc.join, 2)
        self._reader.cancel()
        self._tok_task.cancel()
        for ctx in self._ctxs:
            ctx.destroy(linger=0)
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)

    def _on_exit(self) -> None:
        asyncio.get_running_loop().remove_reader(self._proc.sentinel)
        if not self._closing:
            self._proc.join(1)  # the sentinel fires just before the exit status is ready
            self._die(f"the engine core process exited (code {self._proc.exitcode})")

    def fail(self, reason: str) -> None:
        """Declare the engine dead (as if its core had died): fail every request in flight,
        refuse new ones, fire on_dead. Replica sets do this to the others when one dies."""
        self._die(reason)

    def _die(self, reason: str) -> None:
        if self.dead is not None:
            return
        self.dead = reason
        self._settled.set()
        log.error("engine dead: %s", reason)
        for q, _ in self._seqs.values():
            q.put_nowait(EngineDeadError(reason))
        self._seqs.clear()
        if self.on_dead is not None:
            self.on_dead()

    def silent_for(self) -> float:
        """Seconds since the core process last spoke."""
        return time.monotonic() - self.last_heard

    async def _read_loop(self) -> None:
        decode = self._decode
        while True:
            msg = decode((await self._pull.recv(copy=False)).buffer)
            self.last_heard = time.monotonic()
            if type(msg) is m.Outputs:
                self.stats = msg.stats
                if self.observer is not None:
                    self.observer.step(self, msg.stats)
                if self.observer is not None and msg.queue_times:
                    self.observer.queue_times(list(msg.queue_times.values()))
                for rid, seconds in msg.queue_times.items():  # for its RequestRecord
                    if rid in self._children:
                        self._queued[rid] = seconds
                for eo in msg.outputs:
                    entry = self._seqs.get(eo.request_id)
                    if entry is not None:
                        entry[0].put_nowait((entry[1], eo))
            elif type(msg) is m.Ready:
                self.info = msgspec.structs.asdict(msg.info)
                self._settle()
            elif type(msg) is m.Error:
                self._die(f"engine start-up failed: {msg.message}")

    def _send(self, msg: m.ToEngine) -> None:
        try:  # never block the event loop: with no core connected (gone), there is no one to tell
            self._push.send(self._encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            pass

    # ---- requests --------------------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        lora_request: LoRARequest | None = None,
        user: str | None = None,
    ) -> AsyncIterator[SeqUpdate]:
        """Yield every update of the request's n sequences until all have finished. `user`:
        the end user the client named (OpenAI's `user`), for the request log and trace.

        Raises ValueError when the core refuses the request, EngineStepError when a step
        fails, EngineDeadError when the core is gone. Closing the iterator early aborts
        whatever is still running (a client that went away frees its KV blocks).
        """
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        if request_id in self._children:
            raise ValueError(f"request_id {request_id!r} is already in use")
        q: asyncio.Queue = asyncio.Queue()
        n = params.num_sequences  # the core runs them as one prompt and n forked sequences
        cids = sequence_ids(request_id, n)
        cparams = [sample_params(params, i) for i in range(n)]
        eos = (self.info or {}).get("eos_token_ids", ())
        states = [OutputState(i, self.tokenizer, prompt_ids, p, eos) for i, p in enumerate(cparams)]
        for i, cid in enumerate(cids):
            self._seqs[cid] = (q, i)
        self._children[request_id] = cids
        self._send(m.Add([m.NewRequest(request_id, prompt_ids, params, lora_request)]))
        plen = len(prompt_ids)
        gen = params.max_tokens or max((self.info or {}).get("max_model_len", 0) - plen, 1)
        work = [plen + gen] + [gen] * (n - 1)  # outstanding_tokens of each sequence
        self.outstanding_tokens += sum(work)
        obs = self.observer
        t0, arrival = time.monotonic(), time.time()
        last = [0.0] * n
        done = [False] * n
        first_at, cached = 0.0, 0  # the first token's time; prompt tokens found cached
        ended = "abort"  # how unfinished sequences end if we leave early: the client went away
        yielded = False
        try:
            while not all(done):
                item = await q.get()
                if isinstance(item, BaseException):
                    ended = "lost" if self.lost_uncounted and not yielded else "error"
                    raise item
                i, eo = item
                if eo.error is not None:
                    bad = eo.finish_reason == REJECTED  # the core refused it: a client error
                    # refused before any output: a 4xx, not counted; after: it ended as error
                    ended = "rejected" if bad and not yielded else "error"
                    raise ValueError(eo.error) if bad else EngineStepError(eo.error)
                st = states[i]
                if st.update(eo):  # a stop string ended it: free its blocks now
                    self._send(m.Abort([cids[i]]))
                k = len(eo.new_token_ids)  # work done: the prompt, with the first token
                spent = work[i] if st.finished else min(work[i], k + plen * (work[i] > gen))
                work[i] -= spent
                self.outstanding_tokens -= spent
                now = time.monotonic()
                if eo.new_token_ids:
                    first_at, cached = first_at or now, cached or eo.num_cached_tokens
                if obs is not None and eo.new_token_ids:  # time to first token, or between
                    obs.tokens(now - (last[i] or t0), len(eo.new_token_ids), first=not last[i])
                    last[i] = now
                if st.finished:
                    done[i] = True
                    self._seqs.pop(cids[i], None)
                    if obs is not None:
                        obs.finished(st.out.finish_reason or "stop", now - t0)
                yielded = True
                yield SeqUpdate(i, st, eo)
        finally:
            self.outstanding_tokens -= sum(work)
            self.abort(request_id)
            if obs is not None and ended not in ("rejected", "lost"):  # aborted, failed: count
                for _ in range(done.count(False)):
                    obs.finished(ended, time.monotonic() - t0)
                reasons = [s.out.finish_reason or "stop" if d else ended
                           for s, d in zip(states, done)]  # fmt: skip
                rec = RequestRecord(request_id, prompt_ids, params, states, reasons, arrival,
                                    time.monotonic() - t0, self._queued.get(request_id),
                                    first_at and first_at - t0, max(last) and max(last) - t0,
                                    cached, user)  # fmt: skip
                obs.request_done(rec)
            self._queued.pop(request_id, None)

    def unload_lora(self, lora_int_id: int) -> None:
        """Tell the core an adapter is gone (its slot and host copy are freed)."""
        if self.dead is None and not self._closing:
            self._send(m.UnloadLora(lora_int_id))

    def abort(self, request_id: str) -> None:
        """Abort every sequence of a request still running (no-op once finished)."""
        cids = self._children.pop(request_id, [])
        left = [c for c in cids if self._seqs.pop(c, None) is not None]
        if left and self.dead is None and not self._closing:
            self._send(m.Abort(left))
