"""Late launch (paged.engine.launch_clock): the step-time model, the serving loop that waits
for requests until the deadline, and the engine feeding the clock under overlap."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import zmq

from paged.engine import messages as m
from paged.engine.async_engine import _core_loop
from paged.engine.launch_clock import BLOCKED_S, SAFETY_S, LaunchClock, shape
from paged.sampling.params import SamplingParams
from paged.scheduled import ScheduledBatch


def batch(num_new: list[int], decodes: int) -> ScheduledBatch:
    return ScheduledBatch(reqs=[object()] * len(num_new), num_new=num_new, num_decodes=decodes)


def test_shape_buckets_decodes_and_prompt_steps():
    assert shape(batch([1] * 5, 5)) == (False, 8)
    assert shape(batch([1] * 8, 8)) == (False, 8)
    assert shape(batch([1], 1)) == (False, 1)
    assert shape(batch([1, 1, 512], 2)) == (True, 3)  # 514 tokens: the third 256
    assert shape(batch([256], 0)) == (True, 1)


def test_deadline_from_measured_steps():
    c = LaunchClock()
    decode = batch([1, 1], 2)
    assert c.deadline() is None  # nothing on the device
    c.launched(decode, host_s=0.001, now=10.0, behind=False)
    assert c.deadline() is None  # this shape's duration not measured yet
    c.launched(decode, host_s=0.001, now=10.002, behind=True)
    assert c.deadline() is None  # two steps on the device: launch the next at once
    c.ended(waited_s=0.003, now=10.006)  # the first ran 6 ms; the second runs from 10.006
    assert c.durations[(False, 2)] == pytest.approx(0.006)
    assert c.deadline() == pytest.approx(10.006 + 0.006 - 2 * 0.001 - SAFETY_S)
    # a result the host did not wait for: when the next step started is unknown
    c.launched(decode, host_s=0.001, now=10.008, behind=True)
    c.ended(waited_s=BLOCKED_S / 2, now=10.013)
    assert c.running == ((False, 2), None) and c.deadline() is None
    assert c.durations[(False, 2)] == pytest.approx(0.006)  # not measured either
    # a prompt step has a shape of its own
    c.launched(batch([1, 1, 500], 2), host_s=0.001, now=10.014, behind=True)
    c.ended(waited_s=0.001, now=10.015)
    assert c.running == ((True, 2), 10.015) and c.deadline() is None


def test_average_moves_toward_new_measurements():
    c = LaunchClock()
    decode = batch([1], 1)
    c.launched(decode, host_s=0.001, now=0.0, behind=False)
    for i in range(40):  # the steps take 8 ms from now on
        c.launched(decode, host_s=0.001, now=0.0, behind=True)
        c.ended(waited_s=0.002, now=(i + 1) * 0.008 if i else 0.010)
    assert c.durations[(False, 1)] == pytest.approx(0.008, rel=1e-3)


class FakeCore:
    """What _core_loop needs of an EngineCore: three steps with a late-launch deadline 60 ms
    after each; records the requests it had when each step began."""

    requests: dict = {}

    def __init__(self) -> None:
        self.added: list[str] = []
        self.steps: list[tuple[float, list[str]]] = []
        self.due: float | None = None

    def has_unfinished(self) -> bool:
        return len(self.steps) < 3

    def launch_deadline(self) -> float | None:
        return self.due

    def add_request(self, rid, prompt, params, lora) -> None:
        self.added.append(rid)

    def step(self) -> list:
        now = time.perf_counter()
        self.steps.append((now, list(self.added)))
        self.due = now + 0.06
        return []

    def metrics(self) -> dict:
        return {}


def test_core_loop_takes_requests_until_the_deadline():
    """A request that arrives while the loop waits for the deadline is in the next step, and
    that step does not begin before the deadline."""
    ctx = zmq.Context()
    addr = f"inproc://late-launch-{id(ctx)}"
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind(addr)
    push.connect(addr)
    encode = m.encoder().encode
    core = FakeCore()
    sent: list = []
    add = m.Add([m.NewRequest("r1", [1, 2], SamplingParams(max_tokens=1))])

    def client():
        while not core.steps:
            time.sleep(0.001)
        time.sleep(0.02)  # 20 ms into the first step's 60 ms
        push.send(encode(add))
        while len(core.steps) < 3:
            time.sleep(0.001)
        push.send(encode(m.Shutdown()))

    t = threading.Thread(target=client)
    t.start()
    _core_loop(core, pull, sent.append, parent=None)  # until the Shutdown
    t.join()
    (t0, first), (t1, second) = core.steps[:2]
    assert first == [] and second == ["r1"]
    assert t1 - t0 >= 0.055  # waited for the deadline (to the ms) though the request came at 20
    pull.close(0)
    push.close(0)
    ctx.term()


def test_engine_feeds_the_clock_under_overlap(tiny_models):
    """With overlapped steps the engine times each step whose result it waited for (here a
    result that takes 3 ms to come, as from a device) and gives the serving loop a deadline
    while a step is in flight; with --no-late-launch it gives none."""
    from paged import LLM

    llm = LLM(tiny_models["llama"], dtype="float32", num_kv_blocks=64, async_scheduling=True)
    core = llm.engine
    launch = core.executor.launch

    def slow_launch(*args, **kw):
        handle = launch(*args, **kw)
        result = handle.result
        handle.result = lambda: (time.sleep(0.003), result())[1]
        return handle

    core.executor.launch = slow_launch
    deadlines = []
    core.add_request("a", list(range(2, 30)), SamplingParams(temperature=0, max_tokens=12))
    while core.has_unfinished():
        core.step()
        deadlines.append(core.launch_deadline())
    assert core.clock.durations and core.clock.host_s is not None
    assert all(d is None or isinstance(d, float) for d in deadlines)
    assert any(d is not None for d in deadlines[2:-1])  # decodes after the first are timed
    core.config = dataclasses.replace(core.config, late_launch=False)
    core.add_request("b", list(range(2, 30)), SamplingParams(temperature=0, max_tokens=4))
    core.step()
    core.step()
    assert core.inflight is not None and core.launch_deadline() is None
