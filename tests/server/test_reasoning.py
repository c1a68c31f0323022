"""Reasoning on a live server (the parsers themselves: test_tool_parsers.py): a tiny random
Qwen2 served with --reasoning-parser deepseek_r1. A logit bias on `</think>` (one token of its
tokenizer) makes seeded sampling end the reasoning part-way; the split must match the raw
text that /v1/completions gives for the same prompt and sampling, streamed or not."""

from __future__ import annotations

import httpx
import pytest
from tool_model import MODEL_ARGS, WEATHER_TOOL, make_tool_model, server_helpers

MSGS = [{"role": "user", "content": "What is 2 + 2?"}]
SAMPLING = {"max_tokens": 30, "temperature": 1.0, "seed": 3}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    d = tmp_path_factory.mktemp("reasoning")
    h = server_helpers()
    flags = ["--reasoning-parser", "deepseek_r1"]
    s = h.start_server([make_tool_model(str(d / "model")), *MODEL_ARGS, *flags], d / "server.log")
    yield s
    h.stop_server(s)


@pytest.fixture(scope="module")
def http(srv):
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def think_end(http) -> int:
    ids = http.post("/tokenize", json={"prompt": "</think>", "add_special_tokens": False})
    assert len(ids.json()["tokens"]) == 1
    return ids.json()["tokens"][0]


def raw_text(http, **kw) -> str:
    """The text the model writes for MSGS, through /v1/completions (no parser)."""
    ids = http.post("/tokenize", json={"messages": MSGS}).json()["tokens"]
    return http.post("/v1/completions", json={"prompt": ids, **SAMPLING, **kw}).json()["choices"][
        0
    ]["text"]


def chat(srv, stream: bool, **kw) -> tuple[str | None, str | None, str]:
    """(reasoning_content, content, finish_reason) through the openai client."""
    import openai

    oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    body = {"model": "tiny-qwen", "messages": MSGS, **SAMPLING, **kw}
    if not stream:
        c = oai.chat.completions.create(**body).choices[0]
        return getattr(c.message, "reasoning_content", None), c.message.content, c.finish_reason
    reasoning, content, reason = "", "", None
    for chunk in oai.chat.completions.create(**body, stream=True):
        d = chunk.choices[0].delta
        r = getattr(d, "reasoning_content", None) or ""
        assert not (r and content), "reasoning after content"
        reasoning, content = reasoning + r, content + (d.content or "")
        reason = chunk.choices[0].finish_reason or reason
    return reasoning or None, content or None, reason


def test_reasoning_then_content(srv, http, think_end):
    bias = {"logit_bias": {str(think_end): 8}}
    text = raw_text(http, **bias)
    assert "</think>" in text  # the seed and bias end the reasoning part-way
    reasoning, _, content = text.partition("</think>")
    for stream in (False, True):
        assert chat(srv, stream, **bias) == (reasoning or None, content or None, "length")


def test_unfinished_reasoning_is_all_reasoning(srv, http):
    text = raw_text(http)
    assert "</think>" not in text
    for stream in (False, True):
        assert chat(srv, stream) == (text, None, "length")


def test_structured_outputs_with_reasoning_refused(http):
    """Until the engine can start a grammar after `</think>`, constraining the whole output
    (the reasoning too) would be wrong: a 400 naming the field."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    cases = [
        ({"tools": [WEATHER_TOOL], "tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER_TOOL], "tool_choice": named}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"structured_outputs": {"regex": "[a-z]+"}}, "structured_outputs"),
    ]
    for kw, param in cases:
        r = http.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 5, **kw})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (kw, r.text)


def test_qwen3_reads_the_prompt():
    """qwen3: a prompt that closed an empty think block (enable_thinking false) leaves the
    whole output as content, and structured outputs may constrain it from the start."""
    from paged.server.chat_parsing import ChatParsing, ParsingOptions
    from paged.server.protocol import ChatCompletionRequest

    opts, req = ParsingOptions(reasoning_parser="qwen3"), ChatCompletionRequest(messages=MSGS)
    off = ChatParsing(opts, req, "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert off.reasoning_end is None
    assert off.message("<think>x</think>y")[0] == {
        "role": "assistant",
        "reasoning_content": None,
        "content": "<think>x</think>y",
    }
    on = ChatParsing(opts, req, "<|im_start|>assistant\n")
    assert on.reasoning_end == "</think>"
    assert on.message("<think>x</think>y")[0]["reasoning_content"] == "x"
    st = on.streamer()
    deltas = [st.feed(c, False) for c in "<think>x</think>y"] + [st.feed("", True)]
    assert [d for d in deltas if d] == [{"reasoning_content": "x"}, {"content": "y"}]
