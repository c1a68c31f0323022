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
from paged.engine.launch_clock import BLOCKED_S, SAFETY_S, WINDOW, LaunchClock, shape
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
    assert c.deadline(10.0) is None  # nothing on the device
    c.launched(decode, host_s=0.001, now=10.0, behind=False)
    assert c.deadline(10.0) is None  # this shape's duration not measured yet
    c.launched(decode, host_s=0.001, now=10.002, behind=True)
    assert c.deadline(10.002) is None  # two steps on the device: launch the next at once
    c.ended(waited_s=0.003, now=10.010)  # the first ran 10 ms; the second runs from 10.010
    assert list(c.durations[(False, 2)]) == pytest.approx([0.010])
    assert c.deadline(10.010) == pytest.approx(10.010 + 0.010 - 2 * 0.001 - SAFETY_S)
    assert c.deadline(10.017) is None  # under a millisecond away: at once
    # a result the host did not wait for: when the next step started is unknown
    c.launched(decode, host_s=0.001, now=10.012, behind=True)
    c.ended(waited_s=BLOCKED_S / 2, now=10.023)
    assert c.running == ((False, 2), None) and c.deadline(10.023) is None
    assert list(c.durations[(False, 2)]) == pytest.approx([0.010])  # not measured either
    # a prompt step has a shape of its own
    c.launched(batch([1, 1, 500], 2), host_s=0.001, now=10.024, behind=True)
    c.ended(waited_s=0.001, now=10.025)
    assert c.running == ((True, 2), 10.025) and c.deadline(10.025) is None


def test_estimate_leans_early():
    """The shortest of the shape's last WINDOW device times, less twice the longest recent
    host time: a step that runs shorter than the average still finds the next one queued."""
    c = LaunchClock()
    decode = batch([1], 1)
    c.launched(decode, host_s=0.001, now=0.0, behind=False)
    t = 0.0
    for ms, host in [(12, 1), (10, 3), (14, 1), (11, 1)]:
        c.launched(decode, host_s=host / 1e3, now=t + 0.001, behind=True)
        t += ms / 1e3
        c.ended(waited_s=0.002, now=t)
    assert c.deadline(t) == pytest.approx(t + 0.010 - 2 * 0.003 - SAFETY_S)
    for _ in range(WINDOW):  # the 10 ms step leaves the window
        c.launched(decode, host_s=0.001, now=t + 0.001, behind=True)
        t += 0.012
        c.ended(waited_s=0.002, now=t)
    assert c.deadline(t) == pytest.approx(t + 0.012 - 2 * 0.001 - SAFETY_S)


def test_margin_grows_when_a_launch_came_late():
    """A step launched at a deadline after the one in flight had ended (the host found its
    result without waiting: the device idled) counts as missed and doubles the margin; on-time
    launches shrink it back toward SAFETY_S. Steps launched at once count as neither."""
    c = LaunchClock()
    decode = batch([1], 1)
    c.launched(decode, host_s=0.001, now=0.0, behind=False)
    c.launched(decode, host_s=0.001, now=0.001, behind=True)
    c.ended(waited_s=0.005, now=0.010)
    t = 0.010
    due = c.deadline(t)
    assert due is not None
    c.launched(decode, host_s=0.001, now=due + 0.001, behind=True)
    c.ended(waited_s=0.0, now=due + 0.012)  # it had ended before the launch
    assert (c.launches, c.missed) == (1, 1) and c.margin == pytest.approx(2 * SAFETY_S)
    c.launched(decode, host_s=0.001, now=due + 0.013, behind=True)  # at once: no deadline
    c.ended(waited_s=0.005, now=due + 0.020)
    assert (c.launches, c.missed) == (1, 1)
    t = due + 0.020
    for _ in range(200):  # on time from now on
        due = c.deadline(t)
        assert due is not None
        c.launched(decode, host_s=0.001, now=due, behind=True)
        t += 0.009
        c.ended(waited_s=0.002, now=t)
    assert c.launches == 201 and c.missed == 1 and c.margin == pytest.approx(SAFETY_S)
    c.reset_counters()
    assert (c.launches, c.missed) == (0, 0)


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
    result that takes 20 ms to come, as from a device) and gives the serving loop a deadline
    while a step is in flight; with --no-late-launch it gives none."""
    from paged import LLM

    llm = LLM(tiny_models["llama"], dtype="float32", num_kv_blocks=64, async_scheduling=True)
    core = llm.engine
    launch = core.executor.launch

    def slow_launch(*args, **kw):
        handle = launch(*args, **kw)
        result = handle.result
        handle.result = lambda: (time.sleep(0.02), result())[1]
        return handle

    core.executor.launch = slow_launch
    deadlines = []
    core.add_request("a", list(range(2, 30)), SamplingParams(temperature=0, max_tokens=12))
    while core.has_unfinished():
        core.step()
        deadlines.append(core.launch_deadline())
    assert core.clock.durations and core.clock.host_s
    assert all(d is None or isinstance(d, float) for d in deadlines)
    assert any(d is not None for d in deadlines[2:-1])  # decodes after the first are timed
    core.config = dataclasses.replace(core.config, late_launch=False)
    core.add_request("b", list(range(2, 30)), SamplingParams(temperature=0, max_tokens=4))
    core.step()
    core.step()
    assert core.inflight is not None and core.launch_deadline() is None
