"""AsyncEngine: the EngineCore in its own process, driven from an asyncio server.

The core process owns the model and steps whenever it has work; the server process
tokenizes, detokenizes (OutputState) and streams. They talk over two ZMQ ipc sockets
with pickled tuples:

    server -> core   ("add", [(id, prompt_ids, params), ...]) | ("abort", [ids]) | ("shutdown",)
    core -> server   ("ready", info) | ("error", message) | ("out", outputs, stats, queue_times)

One "out" message per step batches every output of that step with EngineCore.metrics().
If the core process dies, every in-flight request fails with EngineDeadError and
`on_dead` fires (the server then exits non-zero so a supervisor restarts it).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import pickle
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from paged.config import EngineConfig
from paged.engine.core import EngineOutput
from paged.engine.llm import _child_params
from paged.engine.outputs import OutputState
from paged.sampling.params import SamplingParams

log = logging.getLogger("paged")
REJECTED = "rejected"  # finish_reason of a request the core refused in add_request


class EngineDeadError(RuntimeError):
    """The engine core process is gone."""


class EngineStepError(RuntimeError):
    """An engine step failed for this request; the engine itself is still serving."""


# ---- the core process ------------------------------------------------------------------
def _core_main(config: EngineConfig, addr_in: str, addr_out: str, log_level: str) -> None:
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.connect(addr_in)
    push.connect(addr_out)

    def send(*msg: Any) -> None:
        push.send(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))

    try:
        from paged.engine.core import EngineCore

        core = EngineCore(config)
    except Exception as e:  # a clear start-up error, then exit non-zero
        log.exception("engine start-up failed")
        send("error", f"{type(e).__name__}: {e}")
        push.close(linger=2000)
        raise SystemExit(1) from None
    name = core.source.name if core.source is not None else config.model
    send(
        "ready",
        {
            "max_model_len": core.max_model_len,
            "vocab_size": core.vocab_size,
            "model_name": name,
            "num_blocks": core.num_blocks,
            "block_size": config.block_size,
            "platform": core.platform.name,
            "dtype": config.dtype,
            "pid": os.getpid(),
        },
    )
    try:
        _core_loop(core, pull, send)
    finally:
        push.close(linger=1000)
        pull.close(linger=0)


def _core_loop(core: Any, pull: zmq.Socket, send: Callable[..., None]) -> None:
    from paged.engine.request import Status

    ppid = os.getppid()
    arrivals: dict[str, float] = {}  # requests not yet scheduled -> arrival time
    while True:
        rejected: list[EngineOutput] = []
        busy = core.has_unfinished()
        timeout, got = (0 if busy else 1000), False
        while pull.poll(timeout):
            kind, *payload = pickle.loads(pull.recv())
            if kind == "add":
                for rid, ids, params in payload[0]:
                    try:
                        core.add_request(rid, ids, params)
                        arrivals[rid] = time.time()
                    except ValueError as e:
                        rejected.append(EngineOutput(rid, [], True, REJECTED, error=str(e)))
            elif kind == "abort":
                core.abort(payload[0])
            elif kind == "shutdown":
                return
            timeout, got = 0, True
        if not core.has_unfinished():
            if got:  # report aborts and rejections even without a step
                send("out", rejected, core.metrics(), [])
            elif os.getppid() != ppid:  # the server is gone: don't linger
                return
            continue
        t = time.time()
        outs = core.step()
        queue_times = []
        if arrivals:
            done = {eo.request_id for eo in outs}
            for rid, t0 in list(arrivals.items()):
                req = core.requests.get(rid)
                if rid in done or (req is not None and req.status is not Status.WAITING):
                    queue_times.append(t - t0)
                if req is None or req.status is not Status.WAITING:
                    del arrivals[rid]
        send("out", rejected + outs, core.metrics(), queue_times)


# ---- the server side -------------------------------------------------------------------
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
        tokenizer_loader: Callable[[], Any] | None = None,
    ) -> None:
        self.config = config
        self.tokenizer: Any = None  # loaded in a thread while the core starts
        self._load_tokenizer = tokenizer_loader
        self.log_level = log_level
        self.info: dict[str, Any] | None = None  # the core's "ready" message
        self.stats: dict[str, float] = {}  # latest EngineCore.metrics()
        self.dead: str | None = None  # why the core is gone
        self.observer: Any = None  # metrics hooks (server.metrics.ServerMetrics)
        self.on_dead: Callable[[], None] | None = None
        self._seqs: dict[str, tuple[asyncio.Queue, int]] = {}
        self._children: dict[str, list[str]] = {}
        self._ready = asyncio.Event()  # core ready and tokenizer loaded
        self._tokenizer_done = False
        self._dead_evt = asyncio.Event()
        self._proc: Any = None
        self._closing = False

    # ---- lifecycle -----------------------------------------------------------------
    def start(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="paged-")
        addr_in, addr_out = f"ipc://{self._dir}/in", f"ipc://{self._dir}/out"
        self._push = zmq.Context.instance().socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 0)
        self._push.bind(addr_in)
        self._pull = zmq.asyncio.Context.instance().socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._pull.bind(addr_out)
        mp = multiprocessing.get_context("spawn")
        self._proc = mp.Process(
            target=_core_main,
            args=(self.config, addr_in, addr_out, self.log_level),
            name="paged-core",
            daemon=True,
        )
        self._proc.start()
        loop = asyncio.get_running_loop()
        loop.add_reader(self._proc.sentinel, self._on_exit)
        self._reader = loop.create_task(self._read_loop())
        self._tok_task = loop.create_task(self._tokenizer())

    async def _tokenizer(self) -> None:
        if self._load_tokenizer is not None:
            try:
                self.tokenizer = await asyncio.to_thread(self._load_tokenizer)
            except Exception as e:
                self._die(f"cannot load the tokenizer: {e}")
                return
        self._tokenizer_done = True
        if self.info is not None:
            self._ready.set()

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self.dead is None

    async def wait_ready(self) -> bool:
        """Wait for the core's ready message; False when it died instead."""
        waits = [asyncio.ensure_future(e.wait()) for e in (self._ready, self._dead_evt)]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()
        return self.ready

    async def shutdown(self, timeout: float = 5.0) -> None:
        self._closing = True
        if self._proc is None:
            return
        asyncio.get_running_loop().remove_reader(self._proc.sentinel)
        if self._proc.is_alive():
            self._send("shutdown")
            await asyncio.to_thread(self._proc.join, timeout)
        if self._proc.is_alive():
            self._proc.kill()
            await asyncio.to_thread(self._proc.join, 2)
        self._reader.cancel()
        self._tok_task.cancel()
        self._push.close(linger=0)
        self._pull.close(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)

    def _on_exit(self) -> None:
        asyncio.get_running_loop().remove_reader(self._proc.sentinel)
        if not self._closing:
            self._proc.join(1)  # the sentinel fires just before the exit status is ready
            self._die(f"the engine core process exited (code {self._proc.exitcode})")

    def _die(self, reason: str) -> None:
        if self.dead is not None:
            return
        self.dead = reason
        self._dead_evt.set()
        log.error("engine dead: %s", reason)
        for q, _ in self._seqs.values():
            q.put_nowait(EngineDeadError(reason))
        self._seqs.clear()
        if self.on_dead is not None:
            self.on_dead()

    async def _read_loop(self) -> None:
        while True:
            kind, *msg = pickle.loads(await self._pull.recv())
            if kind == "out":
                outs, self.stats, queue_times = msg
                if self.observer is not None and queue_times:
                    self.observer.queue_times(queue_times)
                for eo in outs:
                    entry = self._seqs.get(eo.request_id)
                    if entry is not None:
                        entry[0].put_nowait((entry[1], eo))
            elif kind == "ready":
                self.info = msg[0]
                if self._tokenizer_done:
                    self._ready.set()
            elif kind == "error":
                self._die(f"engine start-up failed: {msg[0]}")

    def _send(self, *msg: Any) -> None:
        self._push.send(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))

    # ---- requests --------------------------------------------------------------------
    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[SeqUpdate]:
        """Yield every update of the request's n sequences until all have finished.

        Raises ValueError when the core refuses the request, EngineStepError when a step
        fails, EngineDeadError when the core is gone. Closing the iterator early aborts
        whatever is still running (a client that went away frees its KV blocks).
        """
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        if request_id in self._children:
            raise ValueError(f"request_id {request_id!r} is already in use")
        q: asyncio.Queue = asyncio.Queue()
        n = params.n
        cids = [f"{request_id}-{i}" if n > 1 else request_id for i in range(n)]
        cparams = [_child_params(params, i) for i in range(n)]
        states = [OutputState(i, self.tokenizer, prompt_ids, p) for i, p in enumerate(cparams)]
        for i, cid in enumerate(cids):
            self._seqs[cid] = (q, i)
        self._children[request_id] = cids
        self._send("add", [(cid, prompt_ids, p) for cid, p in zip(cids, cparams)])
        obs = self.observer
        t0 = time.monotonic()
        last = [0.0] * n
        live = n
        try:
            while live:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                i, eo = item
                if eo.error is not None:
                    if eo.finish_reason == REJECTED:
                        raise ValueError(eo.error)
                    raise EngineStepError(eo.error)
                st = states[i]
                if st.update(eo):  # a stop string ended it: free its blocks now
                    self._send("abort", [cids[i]])
                now = time.monotonic()
                if obs is not None and eo.new_token_ids:
                    if last[i] == 0.0:
                        obs.first_token(now - t0)
                    else:
                        obs.token_gap(now - last[i], len(eo.new_token_ids))
                    last[i] = now
                if st.finished:
                    live -= 1
                    self._seqs.pop(cids[i], None)
                    if obs is not None:
                        obs.finished(st.out.finish_reason or "stop", now - t0)
                yield SeqUpdate(i, st, eo)
        finally:
            self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort every sequence of a request still running (no-op once finished)."""
        cids = self._children.pop(request_id, [])
        left = [c for c in cids if self._seqs.pop(c, None) is not None]
        if left and self.dead is None and not self._closing:
            self._send("abort", left)
