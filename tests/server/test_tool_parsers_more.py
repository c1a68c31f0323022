"""The pythonic, qwen3_coder and phi4_mini_json tool parsers on fixed texts: complete, and
streamed in random chunkings (the deltas must join up to exactly the complete result)."""

from __future__ import annotations

import json

import pytest
from test_tool_parsers import stream_tools
from tool_model import TIME_TOOL, WEATHER_TOOL, chunkings

from paged.server.protocol import ChatCompletionRequest
from paged.server.tool_parsers import TOOL_PARSERS, ToolStreamer
from paged.server.tool_parsers.qwen3_coder import convert

WEATHER = '{"city": "Paris", "unit": "celsius"}'
TYPED_TOOL = {
    "type": "function",
    "function": {
        "name": "book",
        "parameters": {
            "type": "object",
            "properties": {
                "n": {"type": "integer"},
                "price": {"type": "number"},
                "ok": {"type": "boolean"},
                "tags": {"type": "array", "items": {"type": "string"}},
                "opts": {"type": "object"},
                "note": {"type": "string"},
                "maybe": {"type": ["integer", "null"]},
                "either": {"anyOf": [{"type": "integer"}, {"type": "object"}]},
            },
        },
    },
}
TOOLS = [WEATHER_TOOL, TIME_TOOL, TYPED_TOOL]


def qcall(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


TYPED_TEXT = qcall(
    "book",
    n="3",
    price="9.5",
    ok="True",
    tags="['a', \"b\"]",
    opts='{"x": [1, null], "y": "</"}',
    note="42",
    maybe="null",
    either="{'k': (1, 2)}",
    extra="7",
)
TYPED_ARGS = (
    '{"n": 3, "price": 9.5, "ok": true, "tags": ["a", "b"], "opts": {"x": [1, null], '
    '"y": "</"}, "note": "42", "maybe": null, "either": {"k": [1, 2]}, "extra": "7"}'
)

# (parser, text, content, [(name, arguments)], late): late = malformed only after a call's
# name was complete, so a stream has sent that call (it stays sent, as in vLLM)
CASES = [
    # pythonic
    ("pythonic", "The answer is 4.", "The answer is 4.", [], False),
    ("pythonic", "[Note] not a call", "[Note] not a call", [], False),
    ("pythonic", "[1, 2, 3]", "[1, 2, 3]", [], False),
    ("pythonic", "[]", "[]", [], False),
    (
        "pythonic",
        " [get_weather(city=\"Paris\", unit='celsius'), get_time(utc_offset=-2)]\n",
        None,
        [("get_weather", WEATHER), ("get_time", '{"utc_offset": -2}')],
        False,
    ),
    (
        "pythonic",
        '[f(s=\'a, b) ]\\\'\', l=[1, (2, 3.5)], d={\'k\': {"n": None}}, t=True, u="""x\ny""",'
        " j=null, e='é',), g()]",
        None,
        [
            (
                "f",
                '{"s": "a, b) ]\'", "l": [1, [2, 3.5]], "d": {"k": {"n": null}}, "t": true, '
                '"u": "x\\ny", "j": null, "e": "é"}',
            ),
            ("g", "{}"),
        ],
        False,
    ),
    (
        "pythonic",
        '<|python_start|>[get_weather(city="Paris", unit="celsius")]<|python_end|>',
        None,
        [("get_weather", WEATHER)],
        False,
    ),
    ("pythonic", "[f(a=1)] and more", "[f(a=1)] and more", [], True),
    ("pythonic", "[f(a=1, b=", "[f(a=1, b=", [], True),  # cut short
    ("pythonic", "[f(1)]", "[f(1)]", [], True),  # positional
    ("pythonic", "[f(a=__import__('os'))]", "[f(a=__import__('os'))]", [], True),  # not literal
    ("pythonic", "[f(a=1, a=2)]", "[f(a=1, a=2)]", [], True),
    # qwen3_coder
    ("qwen3_coder", "No tools <b>here</b>.\n", "No tools <b>here</b>.\n", [], False),
    (
        "qwen3_coder",
        "Let me check.\n\n"
        + qcall("get_weather", city="Paris", unit="celsius")
        + "\n"
        + qcall("get_time", utc_offset="2"),
        "Let me check.",
        [("get_weather", WEATHER), ("get_time", '{"utc_offset": 2}')],
        False,
    ),
    ("qwen3_coder", TYPED_TEXT, None, [("book", TYPED_ARGS)], False),
    (
        "qwen3_coder",
        "Hi.\n<tool_call><function=f><parameter=a>x < y</function></tool_call>\nBye.",
        "Hi.\n\nBye.",
        [("f", '{"a": "x < y"}')],
        False,
    ),  # a parameter closed by </function>
    ("qwen3_coder", "<tool_call>\n<function=f>\n</function>", None, [("f", "{}")], False),
    (
        "qwen3_coder",
        "<tool_call>\n<function=f>\n<parameter=a>\n1",
        "<tool_call>\n<function=f>\n<parameter=a>\n1",
        [],
        True,
    ),  # cut short
    (
        "qwen3_coder",
        "x <tool_call>\n<function=f>\nstray</function></tool_call>",
        "x <tool_call>\n<function=f>\nstray</function></tool_call>",
        [],
        True,
    ),
    (
        "qwen3_coder",
        'x <tool_call>{"name": "f"}</tool_call>',
        'x <tool_call>{"name": "f"}</tool_call>',
        [],
        False,
    ),
    # phi4_mini_json
    ("phi4_mini_json", "Use functools.partial here.", "Use functools.partial here.", [], False),
    (
        "phi4_mini_json",
        f'functools[{{"name": "get_weather", "arguments": {WEATHER}}}, '
        '{"name": "get_time", "parameters": {"utc_offset": 1}}]',
        None,
        [("get_weather", WEATHER), ("get_time", '{"utc_offset": 1}')],
        False,
    ),
    (
        "phi4_mini_json",
        'Sure. functools[{"name": "f", "arguments": {"a": "]"}}] Done.',
        "Sure.\n\nDone.",
        [("f", '{"a": "]"}')],
        False,
    ),
    (
        "phi4_mini_json",
        'functools[{"name": "f", "arguments": {',
        'functools[{"name": "f", "arguments": {',
        [],
        True,
    ),
    ("phi4_mini_json", "functools[not json]", "functools[not json]", [], False),
]


@pytest.mark.parametrize("name,text,content,calls,late", CASES)
def test_complete_and_streamed(name, text, content, calls, late):
    parser = TOOL_PARSERS[name](TOOLS)
    got_content, got_calls = parser.extract(text)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    for args in (a for _, a in calls):
        json.loads(args)
    for chunks in chunkings(text):
        got = stream_tools(parser, chunks)
        if late:  # the call sent before the output turned out malformed stays sent
            sent = got[1] and got[1][0][0] == "f" and content.startswith(got[0] or "")
            assert got == (content, []) or sent, chunks
        else:
            assert got == (content, calls), chunks


def test_request_models_give_the_schemas():
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=TOOLS)
    for tools in (req.tools, TOOLS):
        assert TOOL_PARSERS["qwen3_coder"](tools).extract(TYPED_TEXT)[1][0].arguments == TYPED_ARGS
    # no tools: every value stays text
    (call,) = TOOL_PARSERS["qwen3_coder"]().extract(qcall("get_time", utc_offset="2"))[1]
    assert call.arguments == '{"utc_offset": "2"}'


@pytest.mark.parametrize(
    "raw,schema,want",
    [
        ("5", {"type": "integer"}, 5),
        ("5.0", {"type": "integer"}, 5),
        ("5.5", {"type": "integer"}, "5.5"),
        ("five", {"type": "integer"}, "five"),
        ("-1e3", {"type": "number"}, -1000.0),
        ("nan", {"type": "number"}, "nan"),
        ("1e999", {"type": "number"}, "1e999"),
        ("false", {"type": "boolean"}, False),
        ("yes", {"type": "boolean"}, "yes"),
        ("[1, 2]", {"type": "object"}, "[1, 2]"),
        ("{1, 2}", {"type": "array"}, "{1, 2}"),  # a Python set: no JSON type
        ("{(1, 2): 3}", {"type": "object"}, "{(1, 2): 3}"),
        ("null", {"type": "string"}, "null"),
        (" spaced ", {"type": "string"}, " spaced "),
        ("[1]", {}, "[1]"),
        ("[1]", None, "[1]"),
    ],
)
def test_qwen3_coder_convert(raw, schema, want):
    assert convert(raw, schema) == want


def test_pythonic_streams_each_argument_as_it_ends():
    text = '[get_weather(city="Paris", unit="celsius")]'
    st, frags, name = ToolStreamer(TOOL_PARSERS["pythonic"]()), [], None
    for ch in text:
        content, deltas = st.feed(ch)
        assert content == ""
        for d in deltas:
            name = d["function"].get("name", name)
            frags.append(d["function"]["arguments"])
    assert name == "get_weather"
    assert frags == ["{", '"city": "Paris"', ', "unit": "celsius"}']  # the `)` ends both


def test_pythonic_content_is_not_held_once_it_cannot_be_a_call_list():
    st = ToolStreamer(TOOL_PARSERS["pythonic"]())
    assert st.feed("[") == ("", [])
    assert st.feed("Note") == ("", [])
    assert st.feed("] x") == ("[Note] x", [])
    assert st.feed(" y") == (" y", [])


def test_registered_and_accepted_by_serve():
    from paged.cli.main import build_parser

    for name in ("pythonic", "qwen3_coder", "phi4_mini_json"):
        assert TOOL_PARSERS[name].name == name
        argv = ["serve", "m", "--enable-auto-tool-choice", "--tool-call-parser", name]
        assert build_parser(argv).parse_args(argv).tool_call_parser == name


@pytest.mark.parametrize("name", ["pythonic", "qwen3_coder", "phi4_mini_json"])
def test_malformed_prefixes_never_raise(name):
    """Every prefix of outputs with a malformed call before a good one, streamed or final."""
    texts = {
        "pythonic": "[f(a=1), g(2), h(b={'x': [)]",
        "qwen3_coder": "a <tool_call><function=f>stray</function></tool_call> b " + qcall("g"),
        "phi4_mini_json": 'a functools[{"name": 1}] b functools[{"name": "g"}]',
    }
    parser, text = TOOL_PARSERS[name](TOOLS), texts[name]
    for n in range(len(text) + 1):
        parser.parse(text[:n], False)
        parser.parse(text[:n], True)
    assert parser.extract(text) == (text, [])
