"""Late launch: when the engine-core loop should schedule the next step under overlap.

With overlapped steps (`EngineCore.step`), step N+1 is scheduled and launched as soon as step
N is on the device, so a request that arrives just after that launch waits for all of N and
N+1 before the step that computes its prompt: a whole step more than without overlap. The
serving loop instead keeps taking requests until shortly before the step in flight is due to
end, then schedules: the device still finds the next step queued when it finishes, and the
requests that arrived meanwhile are in it.

When the step in flight ends is estimated from earlier steps of the same shape (prompt tokens
or not, tokens bucketed): each step's device time is measured from the end of the step before
it (it was queued behind that one) to the moment its result reached a host that was already
waiting for it. The launch is due that long after the step started, less the host's own time to
schedule and launch (measured too, doubled) and a safety margin. Where any of this is unknown
(a shape not seen yet, a result the host did not wait for), there is no deadline: the next step
is scheduled at once, as without late launch.
"""

from __future__ import annotations

from paged.scheduled import ScheduledBatch

ALPHA = 0.25  # weight of a new measurement in the running averages
BLOCKED_S = 50e-6  # a wait for a step's result at least this long saw the step end
SAFETY_S = 0.4e-3  # launch at least this much before the step in flight is due to end

Shape = tuple[bool, int]


def shape(batch: ScheduledBatch) -> Shape:
    """(has prompt tokens, bucket of its tokens): decodes by powers of two of the batch, steps
    with prompt chunks by 256 tokens."""
    tokens = batch.num_tokens
    if batch.num_decodes == len(batch.reqs) and tokens == len(batch.reqs):
        return False, 1 << max(tokens - 1, 0).bit_length()
    return True, -(-tokens // 256)


def _average(old: float | None, new: float) -> float:
    return new if old is None else old + ALPHA * (new - old)


class LaunchClock:
    """The device times of recent steps by shape, and the step in flight: (its shape, when it
    started on the device, None where unknown)."""

    def __init__(self) -> None:
        self.durations: dict[Shape, float] = {}
        self.host_s: float | None = None  # scheduling and launching a step
        self.running: tuple[Shape, float | None] | None = None  # the step on the device
        self.queued: Shape | None = None  # launched behind it

    def launched(self, batch: ScheduledBatch, host_s: float, now: float, behind: bool) -> None:
        """A step was launched at `now`, `host_s` after its scheduling began; `behind`: another
        step is still on the device (it starts when that one ends)."""
        self.host_s = _average(self.host_s, host_s)
        if behind:
            self.queued = shape(batch)
        else:
            self.running, self.queued = (shape(batch), now), None

    def ended(self, waited_s: float, now: float) -> None:
        """The result of the step on the device reached the host at `now` after a wait of
        `waited_s`: the step queued behind it (if any) runs from now on."""
        known = waited_s >= BLOCKED_S  # the host saw the step end
        if self.running is not None and known:
            key, start = self.running
            if start is not None:
                self.durations[key] = _average(self.durations.get(key), now - start)
        self.running = None if self.queued is None else (self.queued, now if known else None)
        self.queued = None

    def deadline(self) -> float | None:
        """The time (time.perf_counter) by which the next step should be launched, or None."""
        if self.running is None or self.queued is not None or self.host_s is None:
            return None
        key, start = self.running
        expected = self.durations.get(key)
        if start is None or expected is None:
            return None
        return start + expected - 2 * self.host_s - SAFETY_S
