"""Metrics under paged: and vllm: names, the request and stats log lines, OpenTelemetry spans:
the parts in process (caplog, an in-memory span exporter), then one live server exporting to
an OTLP/HTTP receiver run by this test, its /metrics checked against docs/grafana/paged.json."""

from __future__ import annotations

import gzip
import logging
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import server_helpers
from tool_model import MODEL_ARGS, make_tool_model

from paged.engine.async_engine import RequestRecord
from paged.engine.outputs import OutputState
from paged.sampling.params import SamplingParams

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "paged.json"
# vLLM's names for what paged exports (vllm/v1/metrics/loggers.py)
VLLM_NAMES = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_preemptions_total",
    "vllm:request_success_total", "vllm:time_to_first_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket", "vllm:time_per_output_token_seconds_bucket",
    "vllm:request_time_per_output_token_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
    "vllm:request_queue_time_seconds_bucket", "vllm:request_prefill_time_seconds_bucket",
    "vllm:request_decode_time_seconds_bucket", "vllm:request_inference_time_seconds_bucket",
    "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket",
    "vllm:request_max_num_generation_tokens_bucket", "vllm:request_params_n_bucket",
    "vllm:request_params_max_tokens_bucket", "vllm:iteration_tokens_total_bucket",
    "vllm:cache_config_info",
]  # fmt: skip


def samples(text: str) -> dict[str, float]:
    """{'name{labels}': value} of every sample."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def names(text: str) -> set[str]:
    return {k.split("{")[0] for k in samples(text)}


def record(rid: str = "cmpl-1", tokens: int = 3, content: str = "SECRET prompt") -> RequestRecord:
    params = SamplingParams(temperature=0.5, top_p=0.9, max_tokens=8, n=1)
    st = OutputState(0, None, [1, 2, 3, 4], params)
    st.out.token_ids, st.out.text, st.out.finish_reason = list(range(tokens)), "the reply", "length"
    return RequestRecord(rid, [1, 2, 3, 4], params, [st], ["length"], time.time() - 2.0, 2.0,
                         0.25, 0.5, 1.5, 2)  # fmt: skip


def metrics(prefix: str = "both"):
    from paged.config import EngineConfig
    from paged.server.metrics import ServerMetrics, cache_config_labels

    stats = {"num_requests_running": 1, "prompt_tokens": 10, "generation_tokens": 4}
    info = lambda: cache_config_labels(EngineConfig(), {"num_blocks": 64})  # noqa: E731
    return ServerMetrics("m", lambda: stats, None, prefix, info)


# ---- in process -----------------------------------------------------------------------------


def test_prefixes():
    both, paged, vllm = (names(metrics(p).render().decode()) for p in ("both", "paged", "vllm"))
    assert set(VLLM_NAMES) <= vllm and not any(n.startswith("paged:") for n in vllm)
    assert not any(n.startswith("vllm:") for n in paged)
    assert {n.replace("paged:", "vllm:") for n in paged} == vllm and both == paged | vllm
    with pytest.raises(ValueError, match="metrics_prefix"):
        metrics("other")


def test_per_request_histograms_and_cache_info():
    m = metrics("vllm")
    m.request_done(record(tokens=3))
    src, other = object(), object()
    m.step(other, {"prompt_tokens_computed": 0, "generation_tokens": 0})  # its first: none
    m.step(src, {"prompt_tokens_computed": 10, "generation_tokens": 2})
    m.step(src, {"prompt_tokens_computed": 12, "generation_tokens": 5})  # 5 tokens this step
    v = samples(m.render().decode())
    lab = '{model_name="m"}'
    assert v[f"vllm:request_prompt_tokens_sum{lab}"] == 4
    assert v[f"vllm:request_generation_tokens_sum{lab}"] == 3
    assert v[f"vllm:request_prefill_time_seconds_sum{lab}"] == pytest.approx(0.25)  # 0.5 - 0.25
    assert v[f"vllm:request_decode_time_seconds_sum{lab}"] == pytest.approx(1.0)
    assert v[f"vllm:request_inference_time_seconds_sum{lab}"] == pytest.approx(1.25)
    assert v[f"vllm:request_time_per_output_token_seconds_sum{lab}"] == pytest.approx(0.5)
    assert v[f"vllm:request_params_max_tokens_sum{lab}"] == 8
    assert v[f"vllm:iteration_tokens_total_count{lab}"] == 1
    assert v[f"vllm:iteration_tokens_total_sum{lab}"] == 5
    info = next(k for k in v if k.startswith("vllm:cache_config_info"))
    assert 'block_size="16"' in info and 'num_gpu_blocks="64"' in info and v[info] == 1


def test_a_failing_listener_is_logged_not_raised(caplog):
    m = metrics()
    m.listeners.append(lambda rec: 1 / 0)
    m.request_done(record())
    assert "request listener" in caplog.text and "ZeroDivisionError" in caplog.text


def test_request_log_line(caplog):
    from paged.server.request_log import RequestLogger

    caplog.set_level(logging.INFO, logger="paged.request")
    RequestLogger()(record("cmpl-abc"))
    (line,) = [r.getMessage() for r in caplog.records if r.name == "paged.request"]
    assert line == ("request cmpl-abc: prompt 4 tokens (2 cached), output 3 tokens, ttft 0.500 s,"
                    " total 2.000 s, queue 0.250 s, finish length")  # fmt: skip
    caplog.clear()

    class Tok:
        def decode(self, ids):
            return "SECRET prompt text"

    RequestLogger(content=True, max_len=6, tokenizer=lambda: Tok())(record("cmpl-abc"))
    (line,) = [r.getMessage() for r in caplog.records if r.name == "paged.request"]
    assert "prompt 'SECRET...'" in line and "output 'the re...'" in line
    assert "'temperature': 0.5" in line and "'max_tokens': 8" in line


def test_request_log_flags():
    from paged.cli.main import build_parser
    from paged.server.request_log import request_logger

    def logger(*flags: str):
        argv = ["serve", *flags]
        return request_logger(build_parser(argv).parse_args(argv), lambda: None)

    assert logger("--disable-log-requests") is None
    assert not logger().content and logger("--enable-log-requests") is not None
    on = logger("--log-requests-content", "--max-log-len", "5")
    assert on.content and on.max_len == 5


def test_stats_line():
    from paged.server.request_log import StatsLogger

    stats = {"prompt_tokens": 0.0, "generation_tokens": 0.0, "num_requests_running": 0}
    sl = StatsLogger(lambda: stats, 1.0)
    level, _ = sl.line()
    assert level == logging.DEBUG  # idle
    stats.update(prompt_tokens=100.0, generation_tokens=50.0, num_requests_running=2,
                 num_requests_waiting=1, kv_cache_usage_perc=0.25, prefix_cache_queries=40,
                 prefix_cache_hits=10)  # fmt: skip
    level, msg = sl.line()
    assert level == logging.INFO
    assert re.fullmatch(
        r"Avg prompt throughput: [\d.]+ tokens/s, Avg generation throughput: [\d.]+ tokens/s, "
        r"Running: 2 reqs, Waiting: 1 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 25.0%",
        msg,
    )


def test_exporter_protocols(monkeypatch):
    """gRPC by default (as vLLM), OTLP/HTTP by OTEL_EXPORTER_OTLP_TRACES_PROTOCOL."""
    from paged.server.tracing import span_exporter

    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)
    assert "grpc" in type(span_exporter("localhost:4317")).__module__
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    assert "http" in type(span_exporter("http://localhost:4318/v1/traces")).__module__
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "carrier-pigeon")
    with pytest.raises(ValueError, match="not grpc or http/protobuf"):
        span_exporter("localhost:4317")


def test_span_attributes():
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from paged.server.tracing import RequestTracer

    exp = InMemorySpanExporter()
    tracer = RequestTracer("tiny", exporter=exp)
    rec = record("cmpl-span")
    tracer(rec)
    tracer.shutdown()
    (span,) = exp.get_finished_spans()
    a = span.attributes
    assert span.name == "llm_request" and span.kind.name == "SERVER"
    assert a["gen_ai.request.id"] == "cmpl-span" and a["gen_ai.response.model"] == "tiny"
    assert (a["gen_ai.usage.prompt_tokens"], a["gen_ai.usage.completion_tokens"]) == (4, 3)
    assert a["gen_ai.latency.time_to_first_token"] == 0.5 and a["gen_ai.latency.e2e"] == 2.0
    assert a["gen_ai.latency.time_in_queue"] == 0.25
    assert a["gen_ai.response.finish_reasons"] == ("length",)
    assert a["gen_ai.request.temperature"] == 0.5 and a["gen_ai.request.max_tokens"] == 8
    assert (span.end_time - span.start_time) == pytest.approx(2e9, rel=1e-6)


# ---- one live server ------------------------------------------------------------------------


class Collector(BaseHTTPRequestHandler):
    """An OTLP/HTTP trace receiver: decodes each export's protobuf into `spans`."""

    spans: list = []

    def do_POST(self) -> None:
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        req = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
        for rs in req.resource_spans:
            service = {a.key: a.value.string_value for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    Collector.spans.append((service, s))
        out = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """(http client, server log, collected spans)."""
    h = server_helpers()
    receiver = HTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    d = tmp_path_factory.mktemp("obs")
    model = make_tool_model(str(d / "model"))
    endpoint = f"http://127.0.0.1:{receiver.server_port}/v1/traces"
    env = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_BSP_SCHEDULE_DELAY": "50"}
    args = [model, *MODEL_ARGS, "--log-level", "info", "--log-stats-interval", "0.5",
            "--otlp-traces-endpoint", endpoint]  # fmt: skip
    srv = h.start_server(args, d / "server.log", env)
    with httpx.Client(base_url=srv.url, timeout=120) as client:
        yield client, srv.log, Collector.spans
    assert h.stop_server(srv) == 0
    receiver.shutdown()


def test_dashboard_names_exist(live):
    """Every metric the Grafana dashboard queries is in /metrics, unchanged."""
    client, _, _ = live
    exported = names(client.get("/metrics").text)
    wanted = set(re.findall(r"vllm:[a-zA-Z_:][a-zA-Z0-9_:]*", DASHBOARD.read_text()))
    assert len(wanted) >= 15 and not wanted - exported, sorted(wanted - exported)
    assert {n.replace("vllm:", "paged:") for n in wanted} <= exported


def test_request_log_metrics_and_span(live):
    client, log, spans = live
    before = samples(client.get("/metrics").text)
    body = {"prompt": "a private prompt", "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "user": "user-42"}  # fmt: skip
    trace, parent = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    r = client.post("/v1/completions", json=body,
                    headers={"traceparent": f"00-{trace}-{parent}-01"}).json()  # fmt: skip
    rid = r["id"]
    after = samples(client.get("/metrics").text)
    lab = '{model_name="tiny-qwen"}'
    for name in (
        "request_prefill_time_seconds_count",
        "request_decode_time_seconds_count",
        "request_prompt_tokens_count",
        "e2e_request_latency_seconds_count",
    ):
        for prefix in ("vllm:", "paged:"):  # fmt: skip
            key = f"{prefix}{name}{lab}"
            assert after[key] - before[key] == 1, key
    assert after[f"vllm:request_generation_tokens_sum{lab}"] - before[
        f"vllm:request_generation_tokens_sum{lab}"] == 4  # fmt: skip
    assert after[f"vllm:iteration_tokens_total_count{lab}"] > before[
        f"vllm:iteration_tokens_total_count{lab}"]  # fmt: skip

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        text = log.read_text()
        lines = [ln for ln in text.splitlines() if f"request {rid}:" in ln]
        got = [s for _, s in spans if s.name == "llm_request"]
        if lines and "Avg prompt throughput" in text and got:
            break
        time.sleep(0.1)
    (line,) = lines
    assert "Avg prompt throughput" in text  # the stats line, while the engine worked
    assert "output 4 tokens" in line and "finish length" in line and "ttft" in line
    assert line.endswith(", user 'user-42'")  # the client's end user
    assert "private" not in text  # never the prompt without --log-requests-content
    span = next(s for _, s in spans if s.name == "llm_request")
    attrs = {a.key: a.value for a in span.attributes}
    assert attrs["gen_ai.request.id"].string_value == rid
    assert attrs["gen_ai.usage.completion_tokens"].int_value == 4
    assert attrs["gen_ai.response.model"].string_value == "tiny-qwen"
    assert attrs["user.id"].string_value == "user-42"
    assert attrs["gen_ai.latency.time_to_first_token"].double_value > 0
    assert spans[0][0]["service.name"] == "paged"
    assert (span.trace_id.hex(), span.parent_span_id.hex()) == (trace, parent)  # the caller's


def test_chat_and_messages_name_their_end_user(live):
    client, log, _ = live
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "user": "u-chat"}
    ids = [client.post("/v1/chat/completions", json=chat).json()["id"]]
    msg = {"model": "tiny-qwen", "max_tokens": 2, "metadata": {"user_id": "u-anthropic"},
           "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
    ids.append(client.post("/v1/messages", json=msg).json()["id"])
    deadline, lines = time.monotonic() + 30, []
    while time.monotonic() < deadline and len(lines) < 2:
        text = log.read_text()
        lines = [ln for rid in ids for ln in text.splitlines() if f"request {rid}:" in ln]
        time.sleep(0.1)
    assert [ln.rsplit(", user ", 1)[-1] for ln in lines] == ["'u-chat'", "'u-anthropic'"]
