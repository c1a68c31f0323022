"""An engine core with overlapped steps on a simulated device, for bench/serve_overhead.py's
`--core overlap`: the real serving loop (`paged.engine.async_engine._core_loop`, late launch
and all) drives `SimCore`, whose steps behave as EngineCore.step does under overlap (a step is
scheduled and launched while the one before it is still on the device, then that one is
resolved) but whose device is a timeline: a step takes --step-ms, plus --prefill-ms-per-1k per
1,000 prompt tokens it computes, after the step before it; resolving waits (sleeps) until
then; --step-jitter spreads each step's device time (a normal factor of mean 1). Scheduling and
launching cost --host-ms of the host's time. Requests get one token a
step, their first in the step that computes their prompt.
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import threading
import time
from collections.abc import Collection
from types import SimpleNamespace
from typing import Any

NUM_BLOCKS = 32768  # the fake KV cache (only for the kv usage gauge)


@dataclasses.dataclass
class SimSeq:
    sid: str
    request_id: str
    prompt_len: int
    max_tokens: int
    rng: random.Random
    scheduled: int = 0  # tokens launched (placeholders included)
    produced: int = 0


class SimCore:
    """What _core_loop asks of an EngineCore, with overlapped steps on a timeline device."""

    def __init__(self, config: Any, spec: Any) -> None:
        from paged.engine.launch_clock import LaunchClock

        self.config, self.spec = config, spec
        self.requests: dict[str, SimpleNamespace] = {}  # request id -> its status
        self.seqs: dict[str, SimSeq] = {}
        self.inflight: tuple | None = None  # (sequences, end on the device)
        self.clock = LaunchClock()
        self.device_free = 0.0  # when the device ends the last step launched
        self.totals = {"prompt_tokens": 0, "generation_tokens": 0}
        self.rng = random.Random(0)  # the device's jitter

    def add_request(self, rid: str, prompt: list[int], params: Any, lora: Any) -> None:
        from paged.engine.request import Status, sequence_ids

        most = params.max_tokens or self.spec.max_model_len - len(prompt)
        for sid in sequence_ids(rid, params.num_sequences):
            self.seqs[sid] = SimSeq(sid, rid, len(prompt), most, random.Random(sid))
        self.requests[rid] = SimpleNamespace(status=Status.WAITING)

    def abort(self, ids: list[str]) -> None:
        for sid in ids:
            self.seqs.pop(sid, None)

    def has_unfinished(self) -> bool:
        return bool(self.seqs) or self.inflight is not None

    def launch_deadline(self) -> float | None:
        from paged.engine.core import EngineCore

        return EngineCore.launch_deadline(self)  # type: ignore[arg-type]  # its fields alike

    def metrics(self) -> dict[str, float]:
        stats = core_stats(self.seqs.values(), self.config.block_size, self.totals)
        return stats | {"late_launches": self.clock.launches,
                        "late_launches_missed": self.clock.missed}  # fmt: skip

    def step(self) -> list:
        from paged.engine.request import Status
        from paged.scheduled import ScheduledBatch

        prev, spec = self.inflight, self.spec
        t0 = time.perf_counter()
        seqs = [s for s in self.seqs.values() if s.scheduled < s.max_tokens]
        launched = None
        if seqs:
            new = [s for s in seqs if s.scheduled == 0]
            prompt = sum({s.request_id: s.prompt_len for s in new}.values())
            for s in seqs:
                s.scheduled += 1
                self.requests[s.request_id].status = Status.RUNNING
            self.totals["prompt_tokens"] += prompt
            time.sleep(spec.host_s)  # preparing the step's inputs, launching it
            now = time.perf_counter()
            busy = spec.step_s + spec.prefill_s_per_token * prompt
            busy *= max(0.2, self.rng.gauss(1.0, spec.jitter)) if spec.jitter else 1.0
            end = max(now, self.device_free) + busy
            self.device_free = end
            batch = ScheduledBatch(reqs=seqs, num_new=[s.prompt_len if s.scheduled == 1 else 1
                                                       for s in seqs],
                                   num_decodes=len(seqs) - len(new))  # fmt: skip
            self.clock.launched(batch, now - t0, now, behind=prev is not None)
            launched = (seqs, end)
        outs = self._resolve(prev) if prev is not None else []
        self.inflight = launched
        return outs

    def _resolve(self, launched: tuple) -> list:
        from paged.engine import messages as m

        seqs, end = launched
        t = time.perf_counter()
        if end > t:
            time.sleep(end - t)
        now = time.perf_counter()
        self.clock.ended(now - t, now)
        outs = []
        for s in seqs:
            sid = s.sid
            if self.seqs.get(sid) is not s:  # aborted meanwhile
                continue
            s.produced += 1
            done = s.produced >= s.max_tokens
            if done:
                del self.seqs[sid]
                if not any(v.request_id == s.request_id for v in self.seqs.values()):
                    self.requests.pop(s.request_id, None)
            tok = s.rng.randrange(self.spec.vocab_size)
            outs.append(m.EngineOutput(sid, [tok], done, "length" if done else None, None,
                                       s.prompt_len, 0))  # fmt: skip
        self.totals["generation_tokens"] += len(outs)
        return outs


def core_stats(seqs: Collection[Any], block_size: int, totals: dict[str, int]) -> dict[str, float]:
    """EngineCore.metrics() of a fake core: its running sequences (.prompt_len, .produced)
    in a KV cache of NUM_BLOCKS blocks, and its token totals."""
    used = sum(-(-(s.prompt_len + s.produced) // block_size) for s in seqs)
    return {"num_requests_running": len(seqs), "num_requests_waiting": 0,
            "kv_cache_usage_perc": used / NUM_BLOCKS, "prefix_cache_queries": 0,
            "prefix_cache_hits": 0, "num_preemptions": 0,
            "prompt_tokens": totals["prompt_tokens"],
            "prompt_tokens_computed": totals["prompt_tokens"],
            "generation_tokens": totals["generation_tokens"],
            "num_free_blocks": NUM_BLOCKS - used, "num_blocks": NUM_BLOCKS,
            "kv_window_released_blocks": 0}  # fmt: skip


def core_process(log_level: str, parent: int | None, addr_in: str, addr_out: str) -> tuple:
    """What _core_main does before its engine: logging, signals left to the server, ending
    with the parent, and the sockets: (context, pull, push)."""
    import zmq

    from paged.engine import async_engine as ae
    from paged.logs import configure_logging

    configure_logging(log_level)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    if parent is not None:
        ae._die_with_parent(parent)
    ctx = zmq.Context()
    ctx.setsockopt(zmq.SNDHWM, 0)
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.connect(addr_in)
    push.connect(addr_out)
    return ctx, pull, push


def overlap_core_main(config: Any, addr_in: str, addr_out: str, log_level: str,
                      parent: int | None, faults: Any, placement: Any,
                      spec: Any) -> None:  # fmt: skip
    """_core_main with SimCore in place of EngineCore: Ready, heartbeats, the real loop."""
    import zmq

    from paged.engine import async_engine as ae
    from paged.engine import messages as m

    ctx, pull, push = core_process(log_level, parent, addr_in, addr_out)
    encode = m.encoder().encode

    def send(msg: Any) -> None:
        try:
            push.send(encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            pass

    core = SimCore(config, spec)
    send(m.Ready(m.EngineInfo(spec.max_model_len, spec.vocab_size, config.model, NUM_BLOCKS,
                              config.block_size, os.getpid(), "sim", str(config.dtype),
                              spec.eos_token_ids)))  # fmt: skip
    stop = threading.Event()
    beat = threading.Thread(target=ae._heartbeat, args=(ctx, addr_out, stop), daemon=True)
    beat.start()
    try:
        ae._core_loop(core, pull, send, parent)
    finally:
        stop.set()
        beat.join(2)
        push.close(linger=1000)
        pull.close(linger=0)
