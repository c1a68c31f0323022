"""Tool calling on a live server (the parsers themselves: test_tool_parsers.py): a tiny random
Qwen2 whose chat template renders tools; tool_choice required and named are enforced by
structured outputs, so even random weights give valid calls; auto, none, and the 400s."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from server_helpers import server_helpers
from tool_model import MODEL_ARGS, TIME_TOOL, WEATHER_TOOL, make_tool_model

# ---- options and request checks (no server) ------------------------------------------------


def test_parsing_options_and_auto_needs_the_flag():
    from paged.server.chat_parsing import ChatParsing, ParsingOptions
    from paged.server.errors import APIError
    from paged.server.protocol import ChatCompletionRequest

    with pytest.raises(ValueError, match="--tool-call-parser"):
        ParsingOptions(tool_call_parser="nope")
    with pytest.raises(ValueError, match="--enable-auto-tool-choice: needs --tool-call-parser"):
        ParsingOptions(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="--reasoning-parser"):
        ParsingOptions(reasoning_parser="nope")
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=[WEATHER_TOOL])
    with pytest.raises(APIError, match="--enable-auto-tool-choice") as e:  # auto is the default
        ChatParsing(ParsingOptions(), req, "")
    assert e.value.param == "tool_choice"
    req.tool_choice = "none"
    assert not ChatParsing(ParsingOptions(), req, "").active


def test_qwen3_coder_types_the_arguments_by_the_requests_schema():
    """The request's tools reach the parser: qwen3_coder's raw parameter text becomes the
    JSON type the tool's schema declares, streamed or not."""
    from paged.server.chat_parsing import ChatParsing, ParsingOptions
    from paged.server.protocol import ChatCompletionRequest

    tool = {"type": "function", "function": {"name": "book", "parameters": {
        "type": "object", "properties": {"seats": {"type": "integer"}, "city": {"type": "string"},
                                         "vip": {"type": "boolean"}}}}}  # fmt: skip
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=[tool])
    opts = ParsingOptions(enable_auto_tool_choice=True, tool_call_parser="qwen3_coder")
    text = ("<tool_call>\n<function=book>\n<parameter=seats>\n2\n</parameter>\n"
            "<parameter=city>\n42\n</parameter>\n<parameter=vip>\ntrue\n</parameter>\n"
            "</function>\n</tool_call>")  # fmt: skip
    msg, called = ChatParsing(opts, req, "").message(text)
    assert called and json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {
        "seats": 2, "city": "42", "vip": True}  # fmt: skip
    streamer, args = ChatParsing(opts, req, "").streamer(), ""
    for i in range(0, len(text), 7):
        out = streamer.feed(text[i : i + 7], i + 7 >= len(text))
        args += "".join(c["function"].get("arguments", "") for c in out.get("tool_calls", []))
    assert json.loads(args) == {"seats": 2, "city": "42", "vip": True}


def test_mistral_keeps_its_special_tag_and_cuts_eos():
    """[TOOL_CALLS] is a special token of Mistral tokenizers: the text keeps special tokens
    (so the parser sees the tag) and the end-of-sequence text is cut off again."""
    from paged.model.loader import load_tokenizer, resolve_model
    from paged.server.chat_parsing import ChatParsing, ParsingOptions
    from paged.server.protocol import ChatCompletionRequest

    tok = load_tokenizer(resolve_model(None))
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=[WEATHER_TOOL])
    hermes = ChatParsing(ParsingOptions(True, "hermes"), req, "")
    assert not hermes.keep_special_tokens(tok)  # <tool_call> is not special here
    mistral = ChatParsing(ParsingOptions(True, "mistral"), req, "")
    assert not mistral.keep_special_tokens(tok)  # no [TOOL_CALLS] token in this vocabulary
    tok.add_tokens(["[TOOL_CALLS]"], special_tokens=True)
    assert mistral.keep_special_tokens(tok)
    text = 'Ok[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]' + tok.eos_token
    msg, called = mistral.message(text)
    assert called and msg["content"] == "Ok"
    assert msg["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'
    st = mistral.streamer()
    assert st.feed("Ok", False) == {"content": "Ok"}
    assert st.feed(tok.eos_token, True) == {}


def test_required_schema_is_vllms():
    from paged.server.chat_parsing import ChatParsing, ParsingOptions
    from paged.server.protocol import ChatCompletionRequest

    req = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}],
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
    )
    schema = ChatParsing(ParsingOptions(), req, "").schema
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    good = [{"name": "get_time", "parameters": {"utc_offset": 2}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "get_time", "parameters": {"city": "x", "unit": "celsius"}}],
                good * 2):  # fmt: skip
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_required_schema_keeps_each_tools_refs():
    """Root-relative refs ($defs, definitions, properties, "#") point at their own tool's
    parameters: two tools may give one $defs name different meanings."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    from paged.sampling.params import StructuredOutputsParams
    from paged.sampling.structured import check_spec
    from paged.server.chat_parsing import required_schema
    from paged.server.protocol import ChatCompletionRequest

    def tool(name: str, params: dict) -> dict:
        return {"type": "function", "function": {"name": name, "parameters": params}}

    a = tool("a", {"type": "object", "properties": {"x": {"$ref": "#/$defs/X"}},
                   "required": ["x"], "$defs": {"X": {"type": "integer"}}})  # fmt: skip
    b = tool("b", {"type": "object", "properties": {
        "x": {"$ref": "#/$defs/X"}, "y": {"$ref": "#/definitions/Y"},
        "z": {"$ref": "#/properties/y"}, "sub": {"$ref": "#"}},
        "required": ["x"], "$defs": {"X": {"type": "string"}},
        "definitions": {"Y": {"type": "boolean"}}})  # fmt: skip
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=[a, b],
                                tool_choice="required")  # fmt: skip
    schema = required_schema(req)
    check_spec(StructuredOutputsParams(json=schema), "tools")
    good = [
        {"name": "a", "parameters": {"x": 1}},
        {"name": "b", "parameters": {"x": "s", "y": True, "z": False, "sub": {"x": "t"}}},
    ]
    jsonschema.validate(good, schema)
    bad = [[{"name": "a", "parameters": {"x": "s"}}], [{"name": "b", "parameters": {"x": 1}}],
           [{"name": "b", "parameters": {"x": "s", "z": 1}}],
           [{"name": "b", "parameters": {"x": "s", "sub": {"x": 1}}}]]  # fmt: skip
    for calls in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(calls, schema)
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    assert _is_grammar_accept_string(grammar, json.dumps(good))
    assert not any(_is_grammar_accept_string(grammar, json.dumps(c)) for c in bad)
    assert a["function"]["parameters"]["properties"]["x"] == {"$ref": "#/$defs/X"}  # a copy


def test_malformed_parameters_and_grammar_stops_are_refused():
    from pydantic import ValidationError

    from paged.server.chat_parsing import ChatParsing, ParsingOptions
    from paged.server.errors import APIError
    from paged.server.protocol import ChatCompletionRequest

    msgs = [{"role": "user", "content": "hi"}]
    for params in ({"$defs": [1]}, {"definitions": {"X": 3}}, {"anyOf": {}}):
        bad = {"type": "function", "function": {"name": "f", "parameters": params}}
        with pytest.raises(ValidationError, match="invalid JSON schema: at ") as e:
            ChatCompletionRequest(messages=msgs, tools=[bad], tool_choice="required")
        assert e.value.errors()[0]["loc"] == ("tools", 0, "function", "parameters")
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice, field in (("required", {"min_tokens": 2}), (named, {"ignore_eos": True})):
        req = ChatCompletionRequest(messages=msgs, tools=TOOLS, tool_choice=choice, **field)
        with pytest.raises(APIError, match="cannot be combined with") as e:
            ChatParsing(ParsingOptions(), req, "")
        assert e.value.param == next(iter(field))


# ---- a live server ---------------------------------------------------------------------------

TOOLS = [WEATHER_TOOL, TIME_TOOL]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MSGS = [{"role": "user", "content": "What is the weather in Paris, and the time in Tokyo?"}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    d = tmp_path_factory.mktemp("tools")
    h = server_helpers()
    flags = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    s = h.start_server([make_tool_model(str(d / "model")), *MODEL_ARGS, *flags], d / "server.log")
    yield s
    h.stop_server(s)


@pytest.fixture(scope="module")
def oai(srv):
    import openai

    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)


def create(oai, stream: bool, **kw):
    """A chat completion as (content, [(name, arguments)], finish_reason), streamed or not."""
    body = dict(
        model="tiny-qwen", messages=MSGS, tools=TOOLS, max_tokens=120, seed=1, temperature=1.0
    )
    body.update(kw)
    if not stream:
        c = oai.chat.completions.create(**body).choices[0]
        calls = [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]
        return c.message.content, calls, c.finish_reason
    content, calls, reason = "", {}, None
    for chunk in oai.chat.completions.create(**body, stream=True):
        ch = chunk.choices[0]
        content += ch.delta.content or ""
        for t in ch.delta.tool_calls or []:
            if t.index not in calls:
                assert t.id and t.function.name and t.type == "function"
                calls[t.index] = [t.function.name, ""]
            calls[t.index][1] += t.function.arguments or ""
        reason = ch.finish_reason or reason
    return content or None, [tuple(calls[i]) for i in sorted(calls)], reason


def check_calls(calls, names=SCHEMAS):
    assert calls
    for name, args in calls:
        assert name in names
        jsonschema.validate(json.loads(args), SCHEMAS[name])


def test_tools_and_tool_results_reach_the_template(srv):
    msgs = [
        *MSGS,
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type":
         "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]  # fmt: skip
    r = httpx.post(srv.url + "/tokenize", json={"messages": msgs, "tools": TOOLS})
    text = httpx.post(srv.url + "/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]
    assert json.dumps(WEATHER_TOOL) in text and json.dumps(TIME_TOOL) in text
    # the arguments reach the template as a mapping, rendered back as JSON
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n' in text
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    body = {"messages": msgs, "tools": TOOLS, "tool_choice": "none", "max_tokens": 2}
    usage = httpx.post(srv.url + "/v1/chat/completions", json=body).json()["usage"]
    assert usage["prompt_tokens"] == r.json()["count"]


def test_required_gives_valid_calls(oai):
    # a seed whose list of calls ends within max_tokens (the random model may go on listing)
    kw = {"tool_choice": "required", "seed": 7}
    got = create(oai, False, **kw)
    assert got[0] is None and got[2] == "tool_calls"
    assert len(got[1]) > 1  # parallel calls
    check_calls(got[1])
    assert create(oai, True, **kw) == got


def test_required_single_call_when_not_parallel(oai):
    kw = {"tool_choice": "required", "parallel_tool_calls": False, "seed": 2}
    content, calls, reason = create(oai, False, **kw)
    assert len(calls) == 1 and reason == "tool_calls"
    check_calls(calls)


def test_named_function_gives_its_arguments(oai):
    named = {"type": "function", "function": {"name": "get_time"}}
    got = create(oai, False, tool_choice=named)
    assert got[0] is None and got[2] == "stop"  # as vLLM and OpenAI: a forced call stops
    assert len(got[1]) == 1 and got[1][0][0] == "get_time"
    check_calls(got[1])
    assert create(oai, True, tool_choice=named) == got


def test_auto_passes_a_plain_answer_through(oai):
    """Random weights never write <tool_call>: the answer is the text tool_choice none gives
    (the same prompt: tools are rendered either way), finished by a stop string."""
    plain, calls, _ = create(oai, False, tool_choice="none", max_tokens=20)
    assert not calls and len(plain) > 8
    stop = plain[4:8]
    want = plain[: plain.index(stop)]
    for stream in (False, True):
        got = create(oai, stream, tool_choice="auto", max_tokens=20, stop=[stop])
        assert got == (want or None, [], "stop")


BAD_TOOL = {"type": "function", "function": {"name": "bad", "parameters": {"type": "strnig"}}}
NAMED_BAD = {"type": "function", "function": {"name": "bad"}}
MALFORMED_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"$defs": [1]}}}


def test_tool_request_errors(oai):
    import openai

    cases = [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [MALFORMED_TOOL], "tool_choice": "required"}, "tools[0].function.parameters"),
        ({"tool_choice": "required", "extra_body": {"min_tokens": 2}}, "min_tokens"),
        ({"tools": openai.NOT_GIVEN, "tool_choice": "required"}, "tool_choice"),
        ({"tools": []}, "tools"),
        ({"tools": [WEATHER_TOOL, WEATHER_TOOL]}, "tools"),
        ({"tools": [TIME_TOOL, BAD_TOOL], "tool_choice": "required"}, "tools"),
        (
            {"tools": [TIME_TOOL, BAD_TOOL], "tool_choice": NAMED_BAD},
            "tools[1].function.parameters",
        ),
        (
            {"tools": [{"type": "function", "function": {"description": "no name"}}]},
            "tools[0].function.name",
        ),  # fmt: skip
        (
            {
                "messages": [
                    *MSGS,
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "1",
                                "type": "function",
                                "function": {"name": "f", "arguments": "{oops"},
                            }
                        ],
                    },
                ]
            },
            "messages[1].tool_calls[0].function.arguments",
        ),  # fmt: skip
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": "x",
                        "tool_calls": [
                            {
                                "id": "1",
                                "type": "function",
                                "function": {"name": "f", "arguments": "{}"},
                            }
                        ],
                    }
                ]
            },
            "messages[0].tool_calls",
        ),  # fmt: skip
    ]
    for kw, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            create(oai, False, **kw)
        assert e.value.body["param"] == param, (kw, e.value.body)


def test_a_call_cut_by_max_tokens_says_length_streamed_or_not(oai):
    """A cut output keeps finish_reason "length"; a started call is kept as far as it came
    (as the stream sent it) after the content before it; streamed or not, the same."""
    call = r'<tool_call>\{"name": "get_time", "arguments": \{"c": "xyz"\}\}</tool_call>'
    kw = {"parallel_tool_calls": False, "extra_body": {"guided_regex": f"Ok {call}\n{call}"}}
    full = oai.chat.completions.create(
        model="tiny-qwen", messages=MSGS, tools=TOOLS, max_tokens=200, seed=1, temperature=1.0,
        logprobs=True, **kw,
    )  # fmt: skip
    assert full.choices[0].finish_reason == "tool_calls"
    texts = [t.token for t in full.choices[0].logprobs.content]
    prefix = ["".join(texts[:c]) for c in range(len(texts) + 1)]

    def first(cond) -> int:  # the first cut whose output so far meets cond
        return next(c for c in range(2, len(texts)) if cond(prefix[c]))

    cuts = {2, first(lambda t: "<tool" in t),  # inside the first tag
            first(lambda t: '"c": "x' in t),  # inside the first call's arguments
            first(lambda t: "</tool_call>" in t),  # the first call just closed
            first(lambda t: t.count("<tool") == 2)}  # inside the second tag  # fmt: skip
    partial = False
    for cut in sorted(cuts):
        got = create(oai, False, max_tokens=cut, **kw)
        assert got[2] == "length" and (not got[1] or got[0] == "Ok"), (cut, got)
        assert len(got[1]) <= 1 and create(oai, True, max_tokens=cut, **kw) == got, cut
        partial = partial or bool(got[1] and got[1][0][1].startswith('{"c": "x'))
    assert partial
