"""Garbage-collector pauses in the serving processes. A full collection scans every tracked
object and stops the whole process meanwhile: every request in flight waits (hundreds of ms
with a model's worth of start-up objects). So, as vLLM does, what exists once start-up is
over (modules, tokenizer tables, captured graphs) is frozen out of the collector's scans, and
a collection that still takes long is logged."""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger("paged")

LONG_S = 0.05  # collections at least this long are logged
_started: list[float] = []


def freeze_startup_objects() -> None:
    """Collect once, then exempt every object alive now from later collections (they live as
    long as the process); and log long collections from here on."""
    gc.collect()
    gc.freeze()
    if _watch not in gc.callbacks:
        gc.callbacks.append(_watch)


def _watch(phase: str, info: dict) -> None:
    if phase == "start":
        _started[:] = [time.perf_counter()]
    elif _started:
        took = time.perf_counter() - _started[0]
        if took >= LONG_S:
            log.info("garbage collection (generation %d) paused this process for %.0f ms",
                     info.get("generation", -1), took * 1e3)  # fmt: skip
