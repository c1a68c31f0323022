"""Compile a set of kernel variants ahead, on several threads, without running them.

Start-up timing (the CUDA plugin's gemv_select, fp8_select, int4_select) tries dozens of
configs per weight shape, and each is a Triton compile of its own: on an empty cache, one
after another, that took minutes for an fp8 8B model. Triton compiles mostly outside the GIL
(MLIR, LLVM and ptxas), so the variants compile side by side on threads. A thread inside
`compile_ahead` turns every launch made through `launcher` into Triton's `warmup` (compile and
cache the variant the arguments pick, launch nothing); the timing that follows finds them
compiled. What the calls return is garbage: they only allocate their outputs.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

log = logging.getLogger("paged")
MAX_WORKERS = 16

_state = threading.local()


def compiling_only() -> bool:
    """Whether this thread is compiling ahead (launches compile and do not run)."""
    return getattr(_state, "on", False)


def launcher(kernel: Any, grid: tuple) -> Callable[..., Any]:
    """`kernel[grid]`, or while this thread compiles ahead, Triton's warmup of that launch."""
    if compiling_only():
        return functools.partial(kernel.warmup, grid=grid)
    return kernel[grid]


def default_workers() -> int:
    """Threads to compile on: the CPUs this process may run on, at most MAX_WORKERS."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(MAX_WORKERS, cpus))


def compile_ahead(
    calls: list[Callable[[], object]],
    within: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    workers: int | None = None,
) -> tuple[int, float]:
    """Run each call on a thread pool with its launches compiling only, each thread inside
    `within()` (the device to compile for, inference mode). A call that raises is skipped:
    whatever it hit, the timing meets it again. Returns (calls that failed, seconds)."""
    t0 = time.perf_counter()

    def run(call: Callable[[], object]) -> bool:
        _state.on = True
        try:
            with within():
                call()
            return True
        except Exception as e:  # noqa: BLE001 (any failure is the timing's to report)
            log.debug("compiling ahead: %r", e)
            return False
        finally:
            _state.on = False

    if not calls:
        return 0, 0.0
    with ThreadPoolExecutor(min(len(calls), workers or default_workers())) as pool:
        done = list(pool.map(run, calls))
    return done.count(False), time.perf_counter() - t0
