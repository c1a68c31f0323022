"""/metrics moves with traffic; a client that goes away mid-stream frees its blocks."""

from __future__ import annotations

import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

MODEL = 'model_name="SmolLM2-135M-Instruct"'


def scrape(http) -> dict[str, float]:
    """{'name{labels}': value} of every sample, labels sorted as rendered."""
    out = {}
    for fam in text_string_to_metric_families(http.get("/metrics").text):
        for s in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def m(values: dict[str, float], name: str, extra: str = "") -> float:
    labels = ",".join(sorted(filter(None, [extra, MODEL])))
    return values[f"paged:{name}{{{labels}}}"]


def test_every_metric_present_with_model_label(http):
    text = http.get("/metrics").text
    for name in [
        "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
        "prefix_cache_queries_total", "prefix_cache_hits_total", "prompt_tokens_total",
        "generation_tokens_total", "num_preemptions_total", "request_success_total",
        "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
        "e2e_request_latency_seconds_bucket", "request_queue_time_seconds_bucket",
    ]:  # fmt: skip
        lines = [ln for ln in text.splitlines() if ln.startswith(f"paged:{name}")]
        assert lines and all(MODEL in ln for ln in lines), name


def test_metrics_move_after_requests(http, client):
    before = scrape(http)
    prompt = "Prefix caching test: " + "the same words again " * 4
    for _ in range(2):  # the second one finds the first one's full blocks
        client.completions.create(model=None, prompt=prompt, max_tokens=3, temperature=0)
    after = scrape(http)
    grew = lambda name, extra="": m(after, name, extra) - m(before, name, extra)  # noqa: E731
    assert grew("prompt_tokens_total") >= 2 * 16
    assert grew("generation_tokens_total") == 6
    assert grew("request_success_total", 'finished_reason="length"') == 2
    assert grew("prefix_cache_queries_total") > 0 and grew("prefix_cache_hits_total") >= 16
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds"):  # fmt: skip
        assert grew(h + "_count") == 2, h
    assert grew("inter_token_latency_seconds_count") == 4
    assert m(after, "num_requests_running") == 0 and m(after, "kv_cache_usage_perc") == 0


def wait_idle(http, timeout: float = 30) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        v = scrape(http)
        idle = m(v, "num_requests_running") == 0 and m(v, "num_requests_waiting") == 0
        if idle and m(v, "kv_cache_usage_perc") == 0 or time.monotonic() > deadline:
            return v
        time.sleep(0.2)


def test_disconnect_mid_stream_frees_blocks(http):
    body = {"prompt": "Tell me a long story. " * 20, "max_tokens": 1000, "ignore_eos": True,
            "stream": True}  # fmt: skip
    with http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(3)]  # a few events (and blank separators) arrive
        assert any(ln.startswith("data: ") for ln in got)
        busy = scrape(http)
        assert m(busy, "kv_cache_usage_perc") > 0 and m(busy, "num_requests_running") == 1
    # leaving the block closed the connection mid-stream
    v = wait_idle(http)
    assert m(v, "num_requests_running") == 0 and m(v, "kv_cache_usage_perc") == 0
    assert m(v, "generation_tokens_total") < m(busy, "generation_tokens_total") + 500


def test_disconnect_before_response_aborts(server, http):
    """A non-streaming request whose client gives up is aborted too."""
    import httpx

    body = {"prompt": "Count to a thousand:", "max_tokens": 1000, "ignore_eos": True}
    headers = {"Authorization": "Bearer test-key-123"}
    before = scrape(http)
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", json=body, headers=headers, timeout=3)
    v = wait_idle(http)
    assert m(v, "num_requests_running") == 0 and m(v, "kv_cache_usage_perc") == 0
    assert m(v, "prompt_tokens_total") > m(before, "prompt_tokens_total")  # it did start
    assert m(v, "generation_tokens_total") - m(before, "generation_tokens_total") < 1000


def test_request_failing_after_tokens_is_counted(http):
    """The engine refuses the regex once it has streamed "ab": the request counts as error,
    with its per-request histograms; one refused before any token stays uncounted."""
    before = scrape(http)
    body = {"prompt": "hi", "max_tokens": 5, "stream": True, "guided_regex": "ab\u0016"}
    assert "error" in http.post("/v1/completions", json=body).text
    assert http.post("/v1/completions", json=body | {"guided_regex": "\u0016"}).status_code == 400
    after = scrape(http)
    grew = lambda name, extra="": m(after, name, extra) - m(before, name, extra)  # noqa: E731
    assert grew("request_success_total", 'finished_reason="error"') == 1
    assert grew("e2e_request_latency_seconds_count") == 1
    assert grew("request_generation_tokens_count") == 1
