"""Prometheus metrics, in their own registry, each with a model_name label.

Latency histograms are observed in the server process (AsyncEngine calls the hooks);
engine gauges and counters are the core's own totals, sent with every batch of outputs,
and exported as they are by a custom collector. With several engine replicas
(--data-parallel-size) these are the sums over the replicas, and each replica's own values
are exported as well, as `paged:replica_*` series labelled `replica` and `platform`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0]
_TTFT += [20.0, 40.0, 80.0]
_ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0]
_ITL += [20.0, 40.0, 80.0]
_E2E = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0]
_E2E += [120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]

# EngineCore.metrics() key -> (metric name, help, is_counter)
_ENGINE = {
    "num_requests_running": ("paged:num_requests_running", "requests in the running batch", 0),
    "num_requests_waiting": ("paged:num_requests_waiting", "requests waiting to be scheduled", 0),
    "kv_cache_usage_perc": ("paged:kv_cache_usage_perc", "fraction of KV blocks in use (0-1)", 0),
    "num_blocks": ("paged:num_kv_blocks", "KV cache blocks in the pool", 0),
    "prefix_cache_queries": ("paged:prefix_cache_queries", "prompt tokens looked up", 1),
    "prefix_cache_hits": ("paged:prefix_cache_hits", "prompt tokens found in the cache", 1),
    "prompt_tokens": ("paged:prompt_tokens", "prompt tokens received", 1),
    "prompt_tokens_computed": (
        "paged:prompt_tokens_computed",
        "prompt tokens the model computed (prefix-cache hits and the n - 1 forked samples not)",
        1,
    ),
    "generation_tokens": ("paged:generation_tokens", "tokens generated", 1),
    "num_preemptions": ("paged:num_preemptions", "requests preempted for lack of blocks", 1),
}


class _EngineCollector(Collector):
    def __init__(
        self,
        model_name: str,
        stats: Callable[[], dict[str, float]],
        replicas: Sequence[Any] | None = None,
    ) -> None:
        self.model_name = model_name
        self.stats = stats
        self.replicas = replicas

    def collect(self) -> Iterator[Metric]:
        stats = self.stats()
        for key, (name, help, counter) in _ENGINE.items():
            cls = CounterMetricFamily if counter else GaugeMetricFamily
            fam = cls(name, help, labels=["model_name"])
            fam.add_metric([self.model_name], float(stats.get(key, 0)))
            yield fam
        if self.replicas:
            yield from self._per_replica(self.replicas)

    def _per_replica(self, replicas: Sequence[Any]) -> Iterator[Metric]:
        """paged:replica_<name> for each engine series, and the router's view: readiness and
        outstanding work (replicas.Replica)."""
        labels = ["model_name", "replica", "platform"]
        rows = [([self.model_name, str(r.index), r.platform], r) for r in replicas]
        for key, (name, help, counter) in _ENGINE.items():
            cls = CounterMetricFamily if counter else GaugeMetricFamily
            per = name.replace("paged:", "paged:replica_")
            fam = cls(per, f"{help}, per replica", labels=labels)
            for lab, r in rows:
                fam.add_metric(lab, float(r.stats.get(key, 0)))
            yield fam
        ready = GaugeMetricFamily("paged:replica_ready", "1 when the replica serves", labels=labels)
        load = GaugeMetricFamily(
            "paged:replica_outstanding_tokens",
            "work sent to the replica and not done: prompt tokens not yet computed plus tokens "
            "still to generate (the router sends each request to the least loaded replica)",
            labels=labels,
        )
        speed = GaugeMetricFamily(
            "paged:replica_speed_tokens_per_second",
            "the router's measure of the replica's throughput while busy (an EWMA of prompt and "
            "generated tokens per second; 0 until measured)",
            labels=labels,
        )
        restarts = CounterMetricFamily(
            "paged:replica_restarts",
            "times the replica was restarted after its engine died or went silent",
            labels=labels,
        )
        for lab, r in rows:
            ready.add_metric(lab, float(r.ready))
            load.add_metric(lab, float(r.load))
            speed.add_metric(lab, float(getattr(r, "speed", None) or 0.0))
            restarts.add_metric(lab, float(getattr(r, "restarts", 0)))
        yield ready
        yield load
        yield speed
        yield restarts


class ServerMetrics:
    """The /metrics registry; AsyncEngine calls tokens, finished and queue_times. `stats`: the
    engine's metrics (summed over replicas); `replicas`: paged.engine.replicas.Replica objects
    (each with index, platform, stats, ready, load), exported per replica when given."""

    def __init__(
        self,
        model_name: str,
        stats: Callable[[], dict[str, float]],
        replicas: Sequence[Any] | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        reg, lab = self.registry, ["model_name"]

        def hist(name: str, help: str, buckets: list[float]) -> Histogram:
            h = Histogram(name, help, lab, buckets=buckets, registry=reg)
            return h.labels(model_name)

        self.ttft = hist("paged:time_to_first_token_seconds", "time to first token", _TTFT)
        self.itl = hist("paged:inter_token_latency_seconds", "time between tokens", _ITL)
        self.e2e = hist("paged:e2e_request_latency_seconds", "request latency", _E2E)
        self.queue = hist("paged:request_queue_time_seconds", "time waiting to be scheduled", _E2E)
        self.success = Counter(
            "paged:request_success",
            "finished sequences by finish reason",
            ["model_name", "finished_reason"],
            registry=reg,
        )
        self.model_name = model_name
        for reason in ("stop", "length", "abort", "error"):
            self.success.labels(model_name, reason)
        reg.register(_EngineCollector(model_name, stats, replicas))

    def tokens(self, seconds: float, num_tokens: int, first: bool) -> None:
        """num_tokens arrived `seconds` after the request started (first) or the last ones."""
        if first:
            self.ttft.observe(seconds)
        else:
            for _ in range(num_tokens):
                self.itl.observe(seconds / num_tokens)

    def finished(self, reason: str, seconds: float) -> None:
        self.success.labels(self.model_name, reason).inc()
        self.e2e.observe(seconds)

    def queue_times(self, seconds: list[float]) -> None:
        for s in seconds:
            self.queue.observe(s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
