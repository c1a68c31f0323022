"""What one connection or request may cost the server: nesting depth of a JSON body, time to
send a request, open file descriptors."""

from __future__ import annotations

import logging
import re
from typing import Any

import numpy as np

log = logging.getLogger("paged.server")

MAX_JSON_DEPTH = 128  # deeper bodies get a 400 before any parser recurses into them
_ESCAPE = re.compile(rb"\\.", re.DOTALL)
_KEEP = b'"[]{}'
_DROP = bytes(c for c in range(256) if c not in _KEEP)
_STEP = np.zeros(256, dtype=np.int8)
_STEP[list(b"[{")], _STEP[list(b"]}")] = 1, -1


def json_depth(body: bytes) -> int:
    """The deepest nesting of arrays and objects in a JSON text, brackets inside strings not
    counted. No recursion and no Python loop over the text: 8 MiB of brackets take ~0.1 s."""
    if body.count(b"[") + body.count(b"{") <= MAX_JSON_DEPTH:
        return 0  # cannot be deeper than the limit: skip the scan
    marks = np.frombuffer(_ESCAPE.sub(b"", body).translate(None, _DROP), dtype=np.uint8)
    in_string = np.cumsum(marks == ord('"'), dtype=np.int32) & 1  # odd quotes so far
    step = _STEP[marks] * (in_string == 0)
    return int(np.cumsum(step, dtype=np.int32).max(initial=0))


def timed_protocol(idle_timeout: float, http: str = "auto") -> type:
    """uvicorn's HTTP/1.1 protocol, closing a connection that has not sent a complete request
    head within `idle_timeout` seconds of opening, or of its last response (uvicorn times out
    only idle keep-alive connections, so a client that connects and sends nothing holds a file
    descriptor forever). http: "httptools" (its C parser), "h11" (pure Python) or "auto" (the
    former when installed, as uvicorn[standard] and vLLM run)."""
    if http == "h11":
        from uvicorn.protocols.http.h11_impl import H11Protocol as base
    else:
        try:
            from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
        except ImportError:  # httptools is not installed
            if http == "httptools":
                raise
            from uvicorn.protocols.http.h11_impl import H11Protocol as base

    class TimedProtocol(base):  # type: ignore[valid-type,misc]
        _idle: Any = None

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def _arm(self) -> None:
            if self._idle is not None:
                self._idle.cancel()
            self._idle = self.loop.call_later(idle_timeout, self._expire)

        def _expire(self) -> None:
            if self.cycle is None or self.cycle.response_complete:  # no request under way
                self.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._idle is not None:
                self._idle.cancel()
            super().connection_lost(exc)

    TimedProtocol.__name__ = TimedProtocol.__qualname__ = f"Timed{base.__name__}"
    return TimedProtocol


def raise_fd_limit(target: int = 65535) -> None:
    """Raise the soft limit on open files towards the hard one (as vLLM does): the common
    default of 1,024 runs out under a few hundred streaming clients."""
    try:
        import resource
    except ImportError:  # not on this OS
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError) as e:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, want, e)
