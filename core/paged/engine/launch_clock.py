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
waiting for it. Launching early costs little (a request arriving meanwhile waits one step
more, as without late launch) but launching late idles the device for every request, so every
estimate leans early: the shortest of the shape's recent device times, less the longest recent
host time to schedule and launch a step (doubled) and a margin. The margin doubles whenever a
launch came too late (the step before it had already ended when the host looked: the device
idled) and shrinks slowly while launches are on time. Where anything is unknown (a shape not
seen yet, a result the host did not wait for), there is no deadline: the next step is
scheduled at once, as without late launch.
"""

from __future__ import annotations

from collections import deque

from paged.scheduled import ScheduledBatch

WINDOW = 8  # recent measurements kept per shape (and of the host's launch time)
BLOCKED_S = 50e-6  # a wait for a step's result at least this long saw the step end
SAFETY_S = 0.4e-3  # the smallest margin before the step in flight is due to end
MAX_MARGIN_S = 8e-3  # the largest
SHRINK = 0.97  # the margin's factor after an on-time launch (doubled after a late one)
MIN_WAIT_S = 1e-3  # a deadline closer than this is no deadline (the loop polls whole ms)

Shape = tuple[bool, int]


def shape(batch: ScheduledBatch) -> Shape:
    """(has prompt tokens, bucket of its tokens): decodes by powers of two of the batch, steps
    with prompt chunks by 256 tokens."""
    tokens = batch.num_tokens
    if batch.num_decodes == len(batch.reqs) and tokens == len(batch.reqs):
        return False, 1 << max(tokens - 1, 0).bit_length()
    return True, -(-tokens // 256)


class LaunchClock:
    """The device times of recent steps by shape, and the step in flight: (its shape, when it
    started on the device, None where unknown)."""

    def __init__(self) -> None:
        self.durations: dict[Shape, deque[float]] = {}
        self.host_s: deque[float] = deque(maxlen=WINDOW)  # scheduling and launching a step
        self.margin = SAFETY_S
        self.running: tuple[Shape, float | None] | None = None  # the step on the device
        self.queued: Shape | None = None  # launched behind it
        self.due_given = False  # deadline() gave one since the last launch
        self.late = False  # the step queued behind the running one was launched at a deadline
        self.reset_counters()

    def reset_counters(self) -> None:
        self.launches = 0  # steps launched at a deadline
        self.missed = 0  # of those, launched after the step before them had ended

    def launched(self, batch: ScheduledBatch, host_s: float, now: float, behind: bool) -> None:
        """A step was launched at `now`, `host_s` after its scheduling began; `behind`: another
        step is still on the device (it starts when that one ends)."""
        self.host_s.append(host_s)
        self.late, self.due_given = behind and self.due_given, False
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
                self.durations.setdefault(key, deque(maxlen=WINDOW)).append(now - start)
        if self.late:  # was the step behind this one launched in time?
            self.launches += 1
            if known:
                self.margin = max(SAFETY_S, self.margin * SHRINK)
            else:
                self.missed += 1
                self.margin = min(MAX_MARGIN_S, self.margin * 2)
        self.running = None if self.queued is None else (self.queued, now if known else None)
        self.queued, self.late, self.due_given = None, False, False

    def deadline(self, now: float) -> float | None:
        """The time (time.perf_counter) by which the next step should be launched, or None
        (at once)."""
        self.due_given = False
        if self.running is None or self.queued is not None or not self.host_s:
            return None
        key, start = self.running
        seen = self.durations.get(key)
        if start is None or not seen:
            return None
        due = start + min(seen) - 2 * max(self.host_s) - self.margin
        if due - now < MIN_WAIT_S:
            return None
        self.due_given = True
        return due
