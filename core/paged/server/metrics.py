"""Prometheus metrics, in their own registry, each with a model_name label.

Latency histograms are observed in the server process (AsyncEngine calls the hooks);
engine gauges and counters are the core's own totals, sent with every batch of outputs,
and exported as they are by a custom collector. With several engine replicas
(--data-parallel-size) these are the sums over the replicas, and each replica's own values
are exported as well, as `paged:replica_*` series labelled `replica` and `platform`.

Every family is exported under vLLM's `vllm:` name as well (--metrics-prefix both, the
default; paged or vllm for one of them), so that vLLM's dashboards work unchanged
(docs/grafana/paged.json, docs/operating.md). The per-request histograms (prefill, decode,
inference and queue time, tokens per request, time per output token) are observed from the
AsyncEngine's RequestRecord of each request that ended.
"""

from __future__ import annotations

import logging
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
_TOKENS = [m * 10**e for e in range(7) for m in (1, 2, 5)]  # vLLM's 1-2-5 buckets
_STEP = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
_N = [1, 2, 5, 10, 20]
PREFIXES = ("both", "paged", "vllm")

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
    "kv_window_released_blocks": (
        "paged:kv_window_released_blocks",
        "KV blocks released early because they fell out of a sliding window",
        1,
    ),
    "late_launches": (
        "paged:late_launches",
        "steps the serving loop launched at a deadline, just before the step in flight ended",
        1,
    ),
    "late_launches_missed": (
        "paged:late_launches_missed",
        "of those, steps launched after the step in flight had ended (the device idled)",
        1,
    ),
    "kernel_compiles": (
        "paged:kernel_compiles",
        "Triton kernels compiled after the start-up warm-up (each stalls the running requests)",
        1,
    ),
    "spec_decode_num_drafts": (
        "paged:spec_decode_num_drafts",
        "speculative decoding: verifications (a request's proposals in one step)",
        1,
    ),
    "spec_decode_num_draft_tokens": (
        "paged:spec_decode_num_draft_tokens", "speculative decoding: tokens proposed", 1,
    ),
    "spec_decode_num_accepted_tokens": (
        "paged:spec_decode_num_accepted_tokens", "speculative decoding: proposals accepted", 1,
    ),
}


_PER_POS = "spec_decode_num_accepted_tokens_per_pos_"


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
        per_pos = sorted(  # spec_decode_num_accepted_tokens_per_pos_<i>: one series each
            (int(k.rsplit("_", 1)[1]), v) for k, v in stats.items() if k.startswith(_PER_POS)
        )
        if per_pos:
            fam = CounterMetricFamily(
                "paged:spec_decode_num_accepted_tokens_per_pos",
                "speculative decoding: proposals accepted at each position",
                labels=["model_name", "position"],
            )
            for i, v in per_pos:
                fam.add_metric([self.model_name, str(i)], float(v))
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


class _CacheConfigInfo(Collector):
    """paged:cache_config_info: 1, the KV cache's configuration in its labels (vLLM's)."""

    def __init__(self, info: Callable[[], dict[str, str]]) -> None:
        self.info = info

    def collect(self) -> Iterator[Metric]:
        labels = self.info()
        fam = GaugeMetricFamily("paged:cache_config_info", "KV cache configuration",
                                labels=list(labels))  # fmt: skip
        fam.add_metric(list(labels.values()), 1.0)
        yield fam


def cache_config_labels(config: Any, info: dict[str, Any] | None) -> dict[str, str]:
    """cache_config_info's labels (vLLM's names) from the EngineConfig and the engine's
    ready info (the block count is known once the engine has sized its cache)."""
    return {
        "block_size": str(config.block_size),
        "cache_dtype": str(getattr(config, "kv_cache_dtype", "auto")),
        "enable_prefix_caching": str(config.enable_prefix_caching),
        "gpu_memory_utilization": str(config.gpu_memory_utilization),
        "num_gpu_blocks": str((info or {}).get("num_blocks", "")),
        "num_cpu_blocks": "0",
        "swap_space": "0",
    }


def _renamed(fam: Metric, prefix: str) -> Metric:
    """A copy of a paged: family under another prefix."""
    name = prefix + fam.name.removeprefix("paged:")
    out = Metric(name, fam.documentation, fam.type, fam.unit)
    out.samples = [s._replace(name=prefix + s.name.removeprefix("paged:")) for s in fam.samples]
    return out


class _Exposition:
    """What /metrics renders: the registry's families under the chosen prefixes."""

    def __init__(self, registry: CollectorRegistry, prefix: str) -> None:
        if prefix not in PREFIXES:
            raise ValueError(f"metrics_prefix: {prefix!r} is not one of {', '.join(PREFIXES)}")
        self.registry, self.prefix = registry, prefix

    def collect(self) -> Iterator[Metric]:
        fams = list(self.registry.collect())
        if self.prefix != "vllm":
            yield from fams
        if self.prefix != "paged":
            for fam in fams:
                yield _renamed(fam, "vllm:")


class ServerMetrics:
    """The /metrics registry; AsyncEngine calls tokens, finished and queue_times. `stats`: the
    engine's metrics (summed over replicas); `replicas`: paged.engine.replicas.Replica objects
    (each with index, platform, stats, ready, load), exported per replica when given."""

    def __init__(
        self,
        model_name: str,
        stats: Callable[[], dict[str, float]],
        replicas: Sequence[Any] | None = None,
        prefix: str = "both",
        cache_info: Callable[[], dict[str, str]] | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        reg, lab = self.registry, ["model_name"]
        self.exposition = _Exposition(reg, prefix)
        # Called with each AsyncEngine RequestRecord: the request log, the tracer.
        self.listeners: list[Callable[[Any], None]] = []

        def hist(name: str, help: str, buckets: list[float]) -> Histogram:
            h = Histogram(name, help, lab, buckets=buckets, registry=reg)
            return h.labels(model_name)

        self.ttft = hist("paged:time_to_first_token_seconds", "time to first token", _TTFT)
        self.itl = hist("paged:inter_token_latency_seconds", "time between tokens", _ITL)
        self.e2e = hist("paged:e2e_request_latency_seconds", "request latency", _E2E)
        self.queue = hist("paged:request_queue_time_seconds", "time waiting to be scheduled", _E2E)
        self.tpot = hist("paged:time_per_output_token_seconds",
                         "time per output token (each token after the first)", _ITL)  # fmt: skip
        self.req_tpot = hist(
            "paged:request_time_per_output_token_seconds",
            "a request's decode time over its tokens after the first",
            _ITL,
        )
        self.prefill = hist("paged:request_prefill_time_seconds",
                            "first scheduled to first token", _E2E)  # fmt: skip
        self.decode = hist("paged:request_decode_time_seconds", "first to last token", _E2E)
        self.inference = hist("paged:request_inference_time_seconds",
                              "first scheduled to last token", _E2E)  # fmt: skip
        self.prompt_len = hist("paged:request_prompt_tokens", "prompt tokens per request", _TOKENS)
        self.gen_len = hist(
            "paged:request_generation_tokens",
            "generated tokens per request (all its sequences)",
            _TOKENS,
        )
        self.max_gen = hist(
            "paged:request_max_num_generation_tokens",
            "generated tokens of a request's longest sequence",
            _TOKENS,
        )
        self.param_n = hist("paged:request_params_n", "the n of each request", _N)
        self.param_max = hist("paged:request_params_max_tokens",
                              "the max_tokens of each request", _TOKENS)  # fmt: skip
        self.step_tokens = hist(
            "paged:iteration_tokens_total", "tokens (prompt and generated) per engine step", _STEP
        )
        self._last_step: dict[int, float] = {}  # id(stats source) -> its last token total
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
        if cache_info is not None:
            reg.register(_CacheConfigInfo(cache_info))

    def tokens(self, seconds: float, num_tokens: int, first: bool) -> None:
        """num_tokens arrived `seconds` after the request started (first) or the last ones."""
        if first:
            self.ttft.observe(seconds)
        else:
            for _ in range(num_tokens):
                self.itl.observe(seconds / num_tokens)
                self.tpot.observe(seconds / num_tokens)

    def step(self, source: object, stats: dict[str, float]) -> None:
        """An engine's metrics after one of its steps: the tokens that step computed."""
        total = stats.get("prompt_tokens_computed", 0) + stats.get("generation_tokens", 0)
        last = self._last_step.get(id(source))
        self._last_step[id(source)] = total
        if last is not None and total > last:
            self.step_tokens.observe(total - last)

    def request_done(self, rec: Any) -> None:
        """An AsyncEngine RequestRecord: per-request histograms, then the listeners."""
        lens = [len(s.out.token_ids) for s in rec.states]
        self.prompt_len.observe(len(rec.prompt_ids))
        self.gen_len.observe(sum(lens))
        self.max_gen.observe(max(lens))
        self.param_n.observe(rec.params.n)
        if rec.params.max_tokens is not None:
            self.param_max.observe(rec.params.max_tokens)
        if rec.first_token:  # timings of a request that produced tokens
            queued = rec.queue_time or 0.0
            self.prefill.observe(max(rec.first_token - queued, 0.0))
            decode = rec.last_token - rec.first_token
            self.decode.observe(decode)
            self.inference.observe(max(rec.last_token - queued, 0.0))
            if max(lens) > 1:
                self.req_tpot.observe(decode / (max(lens) - 1))
        for listener in self.listeners:  # a failing log or exporter never fails the request
            try:
                listener(rec)
            except Exception:
                logging.getLogger("paged.server").exception("request listener %r failed", listener)

    def finished(self, reason: str, seconds: float) -> None:
        self.success.labels(self.model_name, reason).inc()
        self.e2e.observe(seconds)

    def queue_times(self, seconds: list[float]) -> None:
        for s in seconds:
            self.queue.observe(s)

    def render(self) -> bytes:
        return generate_latest(self.exposition)  # type: ignore[arg-type]
