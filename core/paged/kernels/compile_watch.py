"""Report Triton kernels compiled after the start-up warm-up.

A Triton kernel compiles on its first launch with each new set of constexprs and argument
specialisations (an integer argument that is 1, or divisible by 16, is a variant of its own):
up to a second, during which the step waits and every request in it with it, which is what
p99 time to first token shows. The warm-up (paged.engine.warmup) runs the variants a server
meets; one it missed is logged here when it compiles, with the time it took, so that the miss
can be found and added to the warm-up.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

log = logging.getLogger("paged")
MAX_REPORTS = 50  # warnings logged before the watch falls silent

_state = threading.local()


class CompileWatch:
    """Triton's JIT hooks (knobs.runtime.jit_cache_hook, jit_post_compile_hook), chained to
    any installed before; `compiled` counts the compilations seen."""

    def __init__(self) -> None:
        from triton import knobs

        self.runtime = knobs.runtime
        self.before = (self.runtime.jit_cache_hook, self.runtime.jit_post_compile_hook)
        self.compiled = 0
        self.runtime.jit_cache_hook = self._starting
        self.runtime.jit_post_compile_hook = self._compiled

    def _starting(self, **kw: Any) -> bool:
        _state.t0 = time.perf_counter()
        hook = self.before[0]
        return bool(hook(**kw)) if hook is not None else False  # true: skip the compile

    def _compiled(self, **kw: Any) -> Any:
        seconds = time.perf_counter() - getattr(_state, "t0", time.perf_counter())
        self.compiled += 1
        if self.compiled <= MAX_REPORTS:
            log.warning(
                "Triton compiled %s while serving, in %.2f s (a variant the start-up warm-up "
                "did not run)%s",
                kw.get("repr", "a kernel"),
                seconds,
                "; further compilations are not logged" if self.compiled == MAX_REPORTS else "",
            )
        hook = self.before[1]
        return hook(**kw) if hook is not None else None

    def stop(self) -> None:
        self.runtime.jit_cache_hook, self.runtime.jit_post_compile_hook = self.before


def watch_compiles() -> CompileWatch | None:
    """Start reporting compilations; None where Triton (or its hooks) is missing."""
    try:
        return CompileWatch()
    except (ImportError, AttributeError):
        return None
