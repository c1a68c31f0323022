"""OpenTelemetry traces (--otlp-traces-endpoint): one span per request that ended, as vLLM
sends it: named `llm_request`, kind SERVER, from the request's arrival to its end, with vLLM's
gen_ai.* attributes (ids, sampling, token counts, latencies) and the finish reasons; a child of
the caller's span when the HTTP request carries W3C `traceparent` headers.

Spans leave through a BatchSpanProcessor to an OTLP exporter: gRPC by default, as vLLM's;
OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf picks OTLP/HTTP. The exporter is the
optional extra `paged[otel]` (opentelemetry-sdk, opentelemetry-exporter-otlp).
"""

from __future__ import annotations

import argparse
import contextvars
import os
from typing import Any

INSTALL_HINT = "pip install 'paged[otel]' (opentelemetry-sdk and opentelemetry-exporter-otlp)"


def add_tracing_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument_group("traces").add_argument(
        "--otlp-traces-endpoint",
        default=None,
        help="send a span per request to this OpenTelemetry collector (gRPC host:port, or "
        "with OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf an http://host:4318/v1/traces "
        f"URL); needs {INSTALL_HINT}",
    )


# The W3C trace-context headers of the HTTP request being served (set by TraceContext): a
# request's span continues the caller's trace. The RequestRecord listener runs in the request's
# task, so it sees them.
_TRACE_HEADERS: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar(
    "paged_trace_headers", default=None
)


class TraceContext:
    """ASGI middleware: keeps the request's traceparent / tracestate headers for its span."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = {k.decode("latin-1"): v.decode("latin-1")
                       for k, v in scope.get("headers") or []
                       if k in (b"traceparent", b"tracestate")}  # fmt: skip
            if headers:
                token = _TRACE_HEADERS.set(headers)
                try:
                    return await self.app(scope, receive, send)
                finally:
                    _TRACE_HEADERS.reset(token)
        return await self.app(scope, receive, send)


def span_exporter(endpoint: str) -> Any:
    """The OTLP exporter of the protocol OTEL_EXPORTER_OTLP_TRACES_PROTOCOL names (grpc)."""
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        elif protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        else:
            raise ValueError(
                f"otlp_traces_endpoint: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL={protocol!r} is "
                "not grpc or http/protobuf"
            )
    except ImportError as e:
        raise ValueError(
            f"otlp_traces_endpoint: the OTLP {protocol} exporter is not installed ({e.name}): "
            f"{INSTALL_HINT}"
        ) from None
    return OTLPSpanExporter(endpoint=endpoint)


class RequestTracer:
    """A ServerMetrics listener: a span per AsyncEngine RequestRecord. `exporter`: any
    OpenTelemetry SpanExporter (default: the OTLP one of `endpoint`)."""

    def __init__(self, model_name: str, endpoint: str | None = None, exporter: Any = None):
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError:
            raise ValueError(
                f"otlp_traces_endpoint: OpenTelemetry is not installed: {INSTALL_HINT}"
            ) from None
        if exporter is None:
            exporter = span_exporter(endpoint or "")
        attrs = {} if "OTEL_SERVICE_NAME" in os.environ else {"service.name": "paged"}
        self.provider = TracerProvider(resource=Resource.create(attrs))
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("paged")
        self.model_name = model_name

    def attributes(self, rec: Any) -> dict[str, Any]:
        p = rec.params
        out: dict[str, Any] = {
            "gen_ai.request.id": rec.request_id,
            "gen_ai.response.model": self.model_name,
            "gen_ai.request.temperature": p.temperature,
            "gen_ai.request.top_p": p.top_p,
            "gen_ai.request.top_k": p.top_k,
            "gen_ai.request.n": p.n,
            "gen_ai.usage.num_sequences": p.num_sequences,
            "gen_ai.usage.prompt_tokens": len(rec.prompt_ids),
            "gen_ai.usage.completion_tokens": rec.output_tokens,
            "gen_ai.usage.cached_tokens": rec.cached_tokens,
            "gen_ai.response.finish_reasons": list(rec.finish_reasons),
            "gen_ai.latency.e2e": rec.e2e,
        }
        if p.max_tokens is not None:
            out["gen_ai.request.max_tokens"] = p.max_tokens
        if rec.user is not None:  # the request's `user` field
            out["user.id"] = rec.user
        if rec.queue_time is not None:
            out["gen_ai.latency.time_in_queue"] = rec.queue_time
        if rec.first_token:
            queued = rec.queue_time or 0.0
            out["gen_ai.latency.time_to_first_token"] = rec.first_token
            out["gen_ai.latency.time_in_model_prefill"] = max(rec.first_token - queued, 0.0)
            out["gen_ai.latency.time_in_model_decode"] = rec.last_token - rec.first_token
            out["gen_ai.latency.time_in_model_inference"] = max(rec.last_token - queued, 0.0)
        return out

    def __call__(self, rec: Any) -> None:
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        headers = _TRACE_HEADERS.get()
        parent = TraceContextTextMapPropagator().extract(headers) if headers else None
        start = int(rec.arrival * 1e9)
        span = self.tracer.start_span("llm_request", parent, SpanKind.SERVER,
                                      self.attributes(rec), start_time=start)  # fmt: skip
        span.end(end_time=start + int(rec.e2e * 1e9))

    def shutdown(self) -> None:
        """Send what is queued, then stop (at server exit)."""
        self.provider.shutdown()


def with_trace_context(app: Any, tracer: RequestTracer | None) -> Any:
    """The app behind TraceContext when spans are sent."""
    return app if tracer is None else TraceContext(app)
