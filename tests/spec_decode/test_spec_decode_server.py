"""`paged serve --speculative-config` on the default model: a stream whose stop string falls
inside an accepted run ends where plain decoding ends (text, usage); /metrics counts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import httpx
import pytest

from paged import SamplingParams

_spec = importlib.util.spec_from_file_location(
    "paged_reliability_helpers",
    Path(__file__).parents[1] / "reliability" / "reliability_helpers.py",
)
if _spec.name not in sys.modules:
    sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules[_spec.name])
rel = sys.modules[_spec.name]

TEXT = "A journey of a thousand miles begins with a single step. All that glitters is not gold."
PROMPT = f"Copy the text.\nText: {TEXT}\nCopy: {TEXT}\nText: {TEXT}\nCopy:"
SPEC = '{"method": "ngram", "num_speculative_tokens": 4}'


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    args = ["--max-model-len", "1024", "--kv-cache-memory", "64MiB", "--dtype", "float32"]
    srv = rel.start_server([*args, "--speculative-config", SPEC],
                           tmp_path_factory.mktemp("spec") / "server.log")  # fmt: skip
    yield srv
    rel.stop_server(srv)


def test_stream_with_stop_inside_a_run(server, smollm):
    plain = smollm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24),
                            use_tqdm=False)[0].outputs[0]  # fmt: skip
    stop = plain.text[len(plain.text) // 2 : len(plain.text) // 2 + 5]
    want = smollm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24, stop=[stop]),
                           use_tqdm=False)[0].outputs[0]  # fmt: skip
    body = {"model": "SmolLM2-135M-Instruct", "prompt": PROMPT, "max_tokens": 24,
            "temperature": 0, "stop": [stop], "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    text, usage, reason = "", None, None
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = httpx.Response(200, content=line[6:]).json()
            for c in chunk["choices"]:
                text += c["text"]
                reason = c.get("finish_reason") or reason
            usage = chunk.get("usage") or usage
    assert (text, reason) == (want.text, "stop")
    assert usage["completion_tokens"] == len(want.token_ids)
    m = httpx.get(server.url + "/metrics").text
    drafts = rel.metric(m, "paged:spec_decode_num_drafts_total")
    accepted = rel.metric(m, "paged:spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and accepted > 0
    assert "paged:spec_decode_num_accepted_tokens_per_pos_total{model_name=" in m
