"""Reasoning on a live server (the parsers themselves: test_tool_parsers.py): a tiny random
Qwen2 served with --reasoning-parser deepseek_r1. A logit bias on `</think>` (one token of its
tokenizer) makes seeded sampling end the reasoning part-way; the split must match the raw
text that /v1/completions gives for the same prompt and sampling, streamed or not, and a
structured output (tool_choice required) must start only after the reasoning."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from server_helpers import server_helpers
from tool_model import MODEL_ARGS, WEATHER_TOOL, make_tool_model

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


def chat(srv, stream: bool, **kw) -> dict:
    """reasoning, content, calls [(name, arguments)] and finish through the openai client."""
    import openai

    oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    body = {"model": "tiny-qwen", "messages": MSGS, **SAMPLING, **kw}
    if not stream:
        c = oai.chat.completions.create(**body).choices[0]
        calls = [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]
        reasoning = getattr(c.message, "reasoning_content", None)
        return {"reasoning": reasoning, "content": c.message.content, "calls": calls,
                "finish": c.finish_reason}  # fmt: skip
    reasoning, content, calls, reason = "", "", {}, None
    for chunk in oai.chat.completions.create(**body, stream=True):
        d = chunk.choices[0].delta
        r = getattr(d, "reasoning_content", None) or ""
        assert not (r and (content or calls)), "reasoning after content"
        reasoning, content = reasoning + r, content + (d.content or "")
        for t in d.tool_calls or []:
            calls.setdefault(t.index, [t.function.name, ""])[1] += t.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    return {"reasoning": reasoning or None, "content": content or None,
            "calls": [tuple(calls[i]) for i in sorted(calls)], "finish": reason}  # fmt: skip


def test_reasoning_then_content(srv, http, think_end):
    bias = {"logit_bias": {str(think_end): 8}}
    text = raw_text(http, **bias)
    assert "</think>" in text  # the seed and bias end the reasoning part-way
    reasoning, _, content = text.partition("</think>")
    want = {"reasoning": reasoning, "content": content or None, "calls": [], "finish": "length"}
    for stream in (False, True):
        assert chat(srv, stream, **bias) == want


def test_unfinished_reasoning_is_all_reasoning(srv, http):
    text = raw_text(http)
    assert "</think>" not in text
    want = {"reasoning": text, "content": None, "calls": [], "finish": "length"}
    for stream in (False, True):
        assert chat(srv, stream) == want


def test_tool_choice_applies_after_the_reasoning(srv, http, think_end):
    """tool_choice required with a reasoning parser: the reasoning is sampled free (the same
    text as without any constraint), then the grammar forces the calls."""
    bias = {"logit_bias": {str(think_end): 8}, "max_tokens": 100}
    reasoning = raw_text(http, **bias).partition("</think>")[0]
    schema = WEATHER_TOOL["function"]["parameters"]
    kw = {**bias, "tools": [WEATHER_TOOL], "tool_choice": "required", "parallel_tool_calls": False}
    got = chat(srv, False, **kw)
    assert got["reasoning"] == reasoning and got["content"] is None
    assert got["finish"] == "tool_calls" and got["calls"]
    for name, args in got["calls"]:
        assert name == "get_weather"
        jsonschema.validate(json.loads(args), schema)
    assert chat(srv, True, **kw) == got


def test_thinking_token_budget_closes_the_reasoning(srv, http):
    """Unbiased, the seed reasons past max_tokens; a budget of 5 keeps the first 5 tokens of
    that reasoning, forces </think>, and the answer follows as content."""
    text = raw_text(http)
    assert "</think>" not in text
    budget = {"extra_body": {"thinking_token_budget": 5}}
    got = chat(srv, False, **budget)
    assert text.startswith(got["reasoning"]) and got["content"]
    n = http.post("/tokenize", json={"prompt": got["reasoning"], "add_special_tokens": False})
    assert n.json()["count"] == 5
    assert got["finish"] == "length" and chat(srv, True, **budget) == got
    r = http.post("/v1/chat/completions", json={"messages": MSGS, "thinking_token_budget": -1})
    assert r.status_code == 400 and "thinking_token_budget" in r.json()["error"]["message"]


def test_forced_end_marker_resumes_a_partial_marker():
    """A marker of several ids is forced from where the output's end already matches it."""
    from paged.sampling.structured import RequestMask

    m = RequestMask(budget=3, end=[7, 8, 9])
    assert m.forced() is None  # under budget
    m.count, m.end_tail = 3, [1, 2, 3]
    assert m.forced() == 7
    m.end_tail = [2, 3, 7]
    assert m.forced() == 8
    m.end_tail = [3, 7, 8]
    assert m.forced() == 9


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


def test_structured_outputs_after_is_checked():
    from paged.sampling.params import SamplingParams, StructuredOutputsParams

    so = StructuredOutputsParams(json_object=True)
    assert SamplingParams(structured_outputs=so, structured_outputs_after=[5]).validate() is None
    for bad in ({"structured_outputs_after": [5]}, {"structured_outputs": so,
                "structured_outputs_after": []}):  # fmt: skip
        with pytest.raises(ValueError, match="structured_outputs_after"):
            SamplingParams(**bad)
