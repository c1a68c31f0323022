"""The Anthropic Messages API (/v1/messages) through the `anthropic` SDK and raw HTTP, on one
server of the default model with tool_model.py's template (it renders tools, tool calls and
results), the hermes tool parser and the qwen3 reasoning parser. Greedy outputs equal chat
completions' for the same conversation; block events join up to the non-streamed content."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from server_helpers import server_helpers
from tool_model import TEMPLATE, TIME_TOOL, WEATHER_TOOL, chunkings

KEY = "anthropic-key"
MODEL = "SmolLM2-135M-Instruct"
GREEDY = {"temperature": 0}  # the SDK no longer declares temperature: sent as extra_body
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [
    {"name": f["name"], "description": f["description"], "input_schema": f["parameters"]}
    for f in (WEATHER_TOOL["function"], TIME_TOOL["function"])
]
STOP_REASON = {"length": "max_tokens", "stop": "end_turn"}  # chat's finish_reason -> Anthropic's
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}  # what thinking off renders

# ---- the translation and the block streams (no server) --------------------------------------


def test_conversation_translates_to_chat_messages():
    from paged.server.anthropic_protocol import MessagesRequest

    req = MessagesRequest(
        max_tokens=5,
        system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        messages=[
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "call it", "signature": ""},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                 "input": {"city": "Oslo", "unit": "celsius"}},
                {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "rain"},
                {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                 "content": [{"type": "text", "text": "timeout"}]},
                {"type": "text", "text": "And now?", "cache_control": {"type": "ephemeral"}}]},
        ],
        tools=TOOLS,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        stop_sequences=["END"],
    )  # fmt: skip
    chat = req.to_chat("qwen3")
    msgs = [m.model_dump(exclude_none=True) for m in chat.messages]
    assert msgs == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "call it",
         "tool_calls": [{"id": "toolu_1", "type": "function", "function": {
             "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}},
             {"id": "toolu_2", "type": "function", "function": {
                 "name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "content": "rain", "tool_call_id": "toolu_1"},
        {"role": "tool", "content": "Error: timeout", "tool_call_id": "toolu_2"},
        {"role": "user", "content": "And now?"},
    ]  # fmt: skip
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.stop == ["END"] and chat.max_tokens == 5
    assert chat.chat_template_kwargs == {"enable_thinking": False}
    assert [t.function.parameters for t in chat.tools] == [t["input_schema"] for t in TOOLS]
    # thinking needs a reasoning parser, and a budget below max_tokens
    think = {"type": "enabled", "budget_tokens": 1024}
    with pytest.raises(ValueError, match="^thinking: this server has no --reasoning-parser"):
        MessagesRequest(max_tokens=2000, messages=USER, thinking=think).to_chat(None)
    with pytest.raises(ValueError, match="^thinking.budget_tokens: must be less than max_tokens"):
        MessagesRequest(max_tokens=800, messages=USER, thinking=think).to_chat("qwen3")
    chat = MessagesRequest(max_tokens=2000, messages=USER, thinking=think).to_chat("qwen3")
    assert chat.chat_template_kwargs == {"enable_thinking": True}
    assert chat.thinking_token_budget == 1024  # enforced as the chat field is


def _refusal(body: dict) -> tuple[str, str]:
    """(param, message) of the 400 a /v1/messages body gets from its validation."""
    from fastapi.exceptions import RequestValidationError
    from pydantic import ValidationError

    from paged.server.anthropic_protocol import MessagesRequest
    from paged.server.errors import validation_error

    with pytest.raises(ValidationError) as e:
        MessagesRequest.model_validate({"max_tokens": 5} | body)
    err = validation_error(RequestValidationError(e.value.errors()))
    return err.param, err.message


def test_errors_name_the_field_once_and_the_deepest():
    user = [{"role": "user", "content": "hi"}]
    tools = {"tools": TOOLS, "messages": user}
    cases = [
        (tools | {"tool_choice": {"type": "tool"}}, "tool_choice.name"),
        (tools | {"tool_choice": {"type": "none", "disable_parallel_tool_use": True}},
         "tool_choice.disable_parallel_tool_use"),
        ({"messages": user, "thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
        ({"messages": user + [{"role": "assistant", "content": [{"type": "tool_use",
          "id": "t", "name": "get_weather", "input": "notdict"}]}]},
         "messages[1].content[0].input"),  # the block's field, not "content: not a string"
        ({"messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "nope", "content": "x"}]}]},
         "messages[0].content[0].tool_use_id"),  # answers no earlier tool_use
    ]  # fmt: skip
    for body, field in cases:
        param, message = _refusal(body)
        assert param == field and message.startswith(f"{field}: "), (param, message)


def test_sdk_dumped_blocks_are_taken_back():
    """Blocks of an earlier reply as the SDK dumps them (citations, caller, ...): accepted."""
    from anthropic.types import TextBlock, ToolUseBlock
    from anthropic.types.direct_caller import DirectCaller

    from paged.server.anthropic_protocol import MessagesRequest

    text = TextBlock(type="text", text="Checking.", citations=None).model_dump()
    call = ToolUseBlock(type="tool_use", id="t1", name="get_weather", input={},
                        caller=DirectCaller(type="direct")).model_dump()  # fmt: skip
    cited = text | {"citations": [{"type": "char_location", "cited_text": "x"}]}
    req = MessagesRequest(max_tokens=5, tools=TOOLS, messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [cited, text, call]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1"}]}])  # fmt: skip
    assert req.chat_messages()[1]["content"] == "Checking.Checking."


def test_block_stream_joins_up_to_the_full_blocks():
    """Reasoning, text and tool calls streamed in any chunking give the non-streamed blocks."""
    from paged.server.chat_parsing import ChatParsing, ParsingOptions
    from paged.server.output_blocks import BlockStream, full_blocks
    from paged.server.protocol import ChatCompletionRequest

    req = ChatCompletionRequest(messages=USER, tools=[WEATHER_TOOL, TIME_TOOL])
    parsing = ChatParsing(ParsingOptions(True, "hermes", "qwen3"), req, "")
    text = ('<think>Paris, so weather.</think>Let me check.\n<tool_call>\n{"name": "get_weather", '
            '"arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n<tool_call>\n'
            '{"name": "get_time", "arguments": {"utc_offset": 1}}\n</tool_call>')  # fmt: skip
    want, called = full_blocks(parsing, text, "toolu")
    assert called
    assert [(b.kind, b.name) for b in want] == [
        ("reasoning", ""), ("text", ""), ("tool", "get_weather"), ("tool", "get_time")
    ]  # fmt: skip
    assert want[0].text == "Paris, so weather." and want[1].text == "Let me check."
    assert want[2].tool_input() == {"city": "Paris", "unit": "celsius"}
    for pieces in chunkings(text, rounds=10):
        bs = BlockStream(parsing, "toolu")
        events = [e for i, p in enumerate(pieces) for e in bs.feed(p, i == len(pieces) - 1)]
        assert [(b.kind, b.text, b.name) for b in bs.blocks] == [
            (b.kind, b.text, b.name) for b in want
        ]
        opened = [e.index for e in events if e.what == "open"]
        closed = [e.index for e in events if e.what == "close"]
        assert opened == closed == [0, 1, 2, 3]
        for i, b in enumerate(bs.blocks):  # the deltas of a block join up to its text
            assert "".join(e.delta for e in events if e.index == i) == b.text


# ---- a live server ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    d = tmp_path_factory.mktemp("anthropic")
    (d / "template.jinja").write_text(TEMPLATE)
    h = server_helpers()
    flags = ["--chat-template", str(d / "template.jinja"), "--api-key", KEY]
    flags += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    flags += ["--reasoning-parser", "qwen3"]
    s = h.start_server([*h.ENGINE_ARGS, *flags], d / "server.log")
    yield s
    h.stop_server(s)


@pytest.fixture(scope="module")
def ant(srv):
    import anthropic

    return anthropic.Anthropic(base_url=srv.url, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def oai(srv):
    import openai

    return openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def chat(oai, messages, **kw):
    body = {"model": MODEL, "messages": messages, "temperature": 0, "extra_body": NO_THINKING}
    return oai.chat.completions.create(**body, **kw)


def test_greedy_text_equals_chat_with_system_prompt(ant, oai):
    m = ant.messages.create(model=MODEL, max_tokens=8, system="Answer briefly.", messages=USER,
                            extra_body=GREEDY)  # fmt: skip
    c = chat(oai, [{"role": "system", "content": "Answer briefly."}, *USER], max_tokens=8)
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant"
    assert m.model == MODEL and [b.type for b in m.content] == ["text"]
    assert m.content[0].text == c.choices[0].message.content
    assert m.stop_reason == STOP_REASON[c.choices[0].finish_reason] and m.stop_sequence is None
    total = m.usage.input_tokens + m.usage.cache_read_input_tokens  # input_tokens: uncached
    assert total == c.usage.prompt_tokens
    assert m.usage.output_tokens == c.usage.completion_tokens
    n = ant.messages.count_tokens(model=MODEL, system="Answer briefly.", messages=USER)
    assert n.input_tokens == total


def test_a_last_assistant_message_is_continued(ant, oai):
    """Anthropic's prefill: the reply continues the final assistant text (no new turn)."""
    turn = [*USER, {"role": "assistant", "content": "The answer is"}]
    m = ant.messages.create(model=MODEL, max_tokens=6, messages=turn, extra_body=GREEDY)
    c = oai.chat.completions.create(
        model=MODEL, messages=turn, temperature=0, max_tokens=6,
        extra_body=NO_THINKING | {"continue_final_message": True, "add_generation_prompt": False},
    )
    assert m.content[0].text == c.choices[0].message.content
    n = ant.messages.count_tokens(model=MODEL, messages=turn)
    assert n.input_tokens == c.usage.prompt_tokens


def test_stream_events_and_final_message(ant, srv):
    body = {"model": MODEL, "max_tokens": 8, "messages": USER, **GREEDY}
    full = ant.messages.create(**{k: v for k, v in body.items() if k != "temperature"},
                               extra_body=GREEDY)  # fmt: skip
    with httpx.stream("POST", srv.url + "/v1/messages", json=body | {"stream": True},
                      headers={"x-api-key": KEY}, timeout=120) as r:  # fmt: skip
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    names = [ln.removeprefix("event: ") for ln in lines[0::2]]
    datas = [json.loads(ln.removeprefix("data: ")) for ln in lines[1::2]]
    assert [d["type"] for d in datas] == names
    deltas = names.count("content_block_delta")
    blocks = ["content_block_start", *["content_block_delta"] * deltas, "content_block_stop"]
    assert names == ["message_start", "ping", *blocks, "message_delta", "message_stop"]
    total = full.usage.input_tokens + full.usage.cache_read_input_tokens
    assert datas[0]["message"]["usage"]["input_tokens"] == total  # before the cache is known
    text = "".join(d["delta"]["text"] for d in datas if d["type"] == "content_block_delta")
    assert text == full.content[0].text
    assert datas[-2]["delta"] == {"stop_reason": full.stop_reason, "stop_sequence": None}
    assert datas[-2]["usage"]["output_tokens"] == full.usage.output_tokens
    with ant.messages.stream(model=MODEL, max_tokens=8, messages=USER, extra_body=GREEDY) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == full.content[0].text
    assert [(b.type, b.text) for b in final.content] == [("text", full.content[0].text)]
    assert final.stop_reason == full.stop_reason
    assert final.usage.output_tokens == full.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == total


def test_stop_sequences(ant):
    plain = ant.messages.create(model=MODEL, max_tokens=16, messages=USER, extra_body=GREEDY)
    text = plain.content[0].text
    stop = text[6:10]
    m = ant.messages.create(model=MODEL, max_tokens=16, messages=USER, stop_sequences=[stop],
                            extra_body=GREEDY)  # fmt: skip
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert "".join(b.text for b in m.content) == text[: text.index(stop)]


def test_tool_use_round_trip(ant, oai):
    """A forced tool call (structured outputs), its result sent back: the same prompt and
    greedy answer as the chat conversation with tool_calls and a tool message."""
    named = {"type": "tool", "name": "get_weather"}
    m = ant.messages.create(model=MODEL, max_tokens=40, messages=USER, tools=TOOLS,
                            tool_choice=named, extra_body=GREEDY)  # fmt: skip
    assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use"]
    call = m.content[0]
    assert call.id.startswith("toolu_") and call.name == "get_weather"
    jsonschema.validate(call.input, TOOLS[0]["input_schema"])
    single = {"type": "any", "disable_parallel_tool_use": True}
    with ant.messages.stream(model=MODEL, max_tokens=40, messages=USER, tools=TOOLS,
                             tool_choice=single, extra_body=GREEDY) as s:  # fmt: skip
        events = list(s)
        final = s.get_final_message()
    assert final.stop_reason == "tool_use" and [b.type for b in final.content] == ["tool_use"]
    pieces = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert json.loads("".join(pieces)) == final.content[0].input
    schema = next(t["input_schema"] for t in TOOLS if t["name"] == final.content[0].name)
    jsonschema.validate(final.content[0].input, schema)
    result = {"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 21 C"}
    turn = [*USER, {"role": "assistant", "content": [c.model_dump(exclude_none=True)
                                                     for c in m.content]},
            {"role": "user", "content": [result]}]  # fmt: skip
    after = ant.messages.create(model=MODEL, max_tokens=8, messages=turn, tools=TOOLS,
                                tool_choice={"type": "none"}, extra_body=GREEDY)  # fmt: skip
    args = json.dumps(call.input)
    openai_turn = [*USER,
                   {"role": "assistant", "content": None, "tool_calls": [{"id": call.id,
                    "type": "function", "function": {"name": call.name, "arguments": args}}]},
                   {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]  # fmt: skip
    c = chat(oai, openai_turn, max_tokens=8, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="none")
    assert after.usage.input_tokens + after.usage.cache_read_input_tokens == c.usage.prompt_tokens
    assert after.content[0].text == c.choices[0].message.content
    assert after.stop_reason == STOP_REASON[c.choices[0].finish_reason]


def test_errors_in_anthropics_shape(ant, srv):
    import anthropic

    def post(body, headers=None):
        r = httpx.post(srv.url + "/v1/messages", json=body,
                       headers=headers or {"x-api-key": KEY}, timeout=60)  # fmt: skip
        return r.status_code, r.json()

    base = {"model": MODEL, "max_tokens": 4, "messages": USER}
    cases = [
        ({"model": MODEL, "messages": USER}, "max_tokens"),
        (base | {"top_logprobs": 2}, "top_logprobs"),
        (base | {"temperature": 1.5}, "temperature"),
        (base | {"max_tokens": 5000}, "max_tokens"),
        (base | {"messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://x"}}]}]}, "messages"),
        (base | {"messages": [{"role": "assistant", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": "x"}]}]}, "messages[0]"),
        (base | {"tool_choice": {"type": "tool", "name": "nope"}, "tools": TOOLS},
         "tool_choice.name"),
        (base | {"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools"),
        (base | {"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        (base | {"output_config": {"effort": "high"}}, "output_config.effort"),
    ]  # fmt: skip
    for body, field in cases:
        status, err = post(body)
        assert status == 400 and err["type"] == "error", (body, err)
        assert err["error"]["type"] == "invalid_request_error"
        assert err["error"]["message"].startswith(field), (field, err)
    status, err = post(base, {"x-api-key": "wrong"})
    assert status == 401 and err["error"]["type"] == "authentication_error"
    assert post(base, {"authorization": f"Bearer {KEY}"})[0] == 200
    with pytest.raises(anthropic.NotFoundError) as e:
        ant.messages.create(model="nope", max_tokens=4, messages=USER)
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.AuthenticationError):
        ant.with_options(api_key="wrong").messages.create(model=MODEL, max_tokens=4, messages=USER)
    # the server still serves
    assert ant.messages.create(model=MODEL, max_tokens=2, messages=USER).usage.output_tokens == 2
