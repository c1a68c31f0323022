"""The server's log: one line per request that ended, and a periodic engine stats line.

The request line (logger `paged.request`, INFO) carries counts and times only, and the end
user its `user` field named; the prompt, output text and sampling parameters only with
--log-requests-content (at most --max-log-len characters each). The stats line (logger
`paged.stats`) every --log-stats-interval seconds, as vLLM prints it: throughput since the
last line, running and waiting requests, KV cache usage, prefix cache hit rate; INFO while
the engine works, DEBUG when it is idle.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

request_log = logging.getLogger("paged.request")
stats_log = logging.getLogger("paged.stats")
_SHOWN = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens", "n",
          "seed")  # fmt: skip


def add_log_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("logs")
    g.add_argument("--disable-log-requests", action="store_true",
                   help="no log line per finished request")  # fmt: skip
    g.add_argument(
        "--enable-log-requests",
        dest="disable_log_requests",
        action="store_false",
        help="a log line per finished request (the default; vLLM's spelling)",
    )
    g.add_argument(
        "--log-requests-content",
        action="store_true",
        help="request log lines also carry the prompt, the output text and the sampling "
        "parameters (never by default)",
    )
    g.add_argument("--max-log-len", type=int, default=None,
                   help="with --log-requests-content: most characters of prompt and output "
                   "shown (default: all)")  # fmt: skip
    g.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic engine stats line")  # fmt: skip
    g.add_argument(
        "--log-stats-interval",
        type=float,
        default=10.0,
        help="seconds between engine stats lines (default: %(default)s)",
    )


def check_log_args(args: argparse.Namespace) -> None:
    if not args.log_stats_interval > 0:  # NaN too
        raise ValueError("log_stats_interval: must be > 0 seconds")
    if args.max_log_len is not None and args.max_log_len < 0:
        raise ValueError("max_log_len: must be >= 0")


def _clip(text: str, limit: int | None) -> str:
    return text if limit is None or len(text) <= limit else text[:limit] + "..."


class RequestLogger:
    """A ServerMetrics listener: logs each AsyncEngine RequestRecord as one line."""

    def __init__(self, content: bool = False, max_len: int | None = None,
                 tokenizer: Callable[[], Any] | None = None) -> None:  # fmt: skip
        self.content, self.max_len = content, max_len
        self.tokenizer = tokenizer or (lambda: None)

    def line(self, rec: Any) -> str:
        ttft = f"{rec.first_token:.3f} s" if rec.first_token else "-"
        queue = f"{rec.queue_time:.3f} s" if rec.queue_time is not None else "-"
        text = (
            f"request {rec.request_id}: prompt {len(rec.prompt_ids)} tokens "
            f"({rec.cached_tokens} cached), output {rec.output_tokens} tokens, ttft {ttft}, "
            f"total {rec.e2e:.3f} s, queue {queue}, finish {','.join(rec.finish_reasons)}"
        )
        if rec.user is not None:  # the client's end-user id (OpenAI's `user`): abuse tracing
            text += f", user {_clip(rec.user, 256)!r}"
        if self.content:
            tok = self.tokenizer()
            prompt = tok.decode(rec.prompt_ids) if tok is not None else str(rec.prompt_ids)
            outputs = [_clip(s.out.text, self.max_len) for s in rec.states]
            params = {k: getattr(rec.params, k) for k in _SHOWN}
            text += f", params {params}, prompt {_clip(prompt, self.max_len)!r}, "
            text += f"output {outputs[0] if len(outputs) == 1 else outputs!r}"
        return text

    def __call__(self, rec: Any) -> None:
        if request_log.isEnabledFor(logging.INFO):
            request_log.info("%s", self.line(rec))


def request_logger(args: argparse.Namespace, tokenizer: Callable[[], Any]) -> RequestLogger | None:
    """The request log the flags ask for (None: --disable-log-requests)."""
    if args.disable_log_requests:
        return None
    return RequestLogger(args.log_requests_content, args.max_log_len, tokenizer)


class StatsLogger:
    """Logs the engine's state every `interval` seconds from its stats (EngineCore.metrics(),
    summed over replicas)."""

    def __init__(self, stats: Callable[[], dict[str, float]], interval: float) -> None:
        self.stats, self.interval = stats, interval
        self._last: tuple[float, float, float] | None = None  # time, prompt, generated tokens

    def line(self) -> tuple[int, str]:
        """(log level, message) now."""
        s, now = self.stats(), time.monotonic()
        prompt, gen = s.get("prompt_tokens", 0.0), s.get("generation_tokens", 0.0)
        t0, p0, g0 = self._last or (now, prompt, gen)
        self._last = (now, prompt, gen)
        dt = max(now - t0, 1e-9)
        p_rate, g_rate = (prompt - p0) / dt, (gen - g0) / dt
        queries = s.get("prefix_cache_queries", 0.0)
        hit = 100 * s.get("prefix_cache_hits", 0.0) / queries if queries else 0.0
        running = int(s.get("num_requests_running", 0))
        waiting = int(s.get("num_requests_waiting", 0))
        msg = (
            f"Avg prompt throughput: {p_rate:.1f} tokens/s, Avg generation throughput: "
            f"{g_rate:.1f} tokens/s, Running: {running} reqs, Waiting: {waiting} reqs, "
            f"KV cache usage: {100 * s.get('kv_cache_usage_perc', 0.0):.1f}%, "
            f"Prefix cache hit rate: {hit:.1f}%"
        )
        idle = not running and not waiting and not p_rate and not g_rate
        return (logging.DEBUG if idle else logging.INFO), msg

    async def run(self) -> None:
        self.line()  # the first interval's start
        while True:
            await asyncio.sleep(self.interval)
            level, msg = self.line()
            stats_log.log(level, "%s", msg)
