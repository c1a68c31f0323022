"""Tool and reasoning parsers on fixed texts: complete, and streamed in random chunkings (the
deltas must join up to exactly the complete result)."""

from __future__ import annotations

import json

import pytest
from tool_model import chunkings

from paged.server.reasoning import REASONING_PARSERS, ReasoningStreamer
from paged.server.tool_parsers import (
    TOOL_PARSERS,
    NamedToolParser,
    RequiredToolParser,
    ToolParser,
    ToolStreamer,
)

WEATHER = '{"city": "Paris", "unit": "celsius"}'
TRICKY = '{"q": "a \\"}\\" b </tool_call> ;", "n": [1, {"x": 2.5e3}], "ok": true, "z": null}'

# (parser, text, content, [(name, arguments)])
TOOL_CASES = [
    ("hermes", "Hello there, <b>friend</b>!\n", "Hello there, <b>friend</b>!\n", []),
    (
        "hermes",
        f'Let me check.\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n'
        "</tool_call>",
        "Let me check.",
        [("get_weather", WEATHER), ("get_time", '{"tz": "CET"}')],
    ),
    (
        "hermes",
        f'<tool_call>{{"arguments": {TRICKY}, "name": "f"}}</tool_call>',
        None,
        [("f", TRICKY)],
    ),
    ("hermes", '<tool_call>\n{"name": "f"}\n</tool_call>\nDone.', "Done.", [("f", "{}")]),
    (
        "hermes",
        'Hi.\n<tool_call>{"name": "f"}</tool_call> \n<tool_call>{"name": "g"}</tool_call>\nBye.\n',
        "Hi.\n\nBye.\n",
        [("f", "{}"), ("g", "{}")],
    ),
    ("hermes", '<tool_call>{"name": "f", "arguments": {}}', None, [("f", "{}")]),  # unclosed
    (
        "hermes",
        'x <tool_call>{"name": oops}</tool_call>',
        'x <tool_call>{"name": oops}</tool_call>',
        [],
    ),
    (
        "hermes",
        '<tool_call>{"name": "f", "arguments": {"a": 1}',
        '<tool_call>{"name": "f", "arguments": {"a": 1}',
        [],
    ),
    ("llama3_json", "The answer is 4.", "The answer is 4.", []),
    (
        "llama3_json",
        f'<|python_tag|>{{"name": "get_weather", "parameters": {WEATHER}}}; '
        '{"name": "noop", "parameters": {}}',
        None,
        [("get_weather", WEATHER), ("noop", "{}")],
    ),
    ("llama3_json", f' {{"name": "f", "parameters": {TRICKY}}}', None, [("f", TRICKY)]),
    (
        "llama3_json",
        '{"name": "f", "parameters": {"a": 1}} trailing',
        '{"name": "f", "parameters": {"a": 1}} trailing',
        [],
    ),
    ("mistral", "No tools needed.", "No tools needed.", []),
    (
        "mistral",
        f'Sure. [TOOL_CALLS][{{"name": "get_weather", "arguments": {WEATHER}}}, '
        f'{{"name": "f", "arguments": {TRICKY}}}]',
        "Sure.",
        [("get_weather", WEATHER), ("f", TRICKY)],
    ),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "f", "arguments": ',
        '[TOOL_CALLS][{"name": "f", "arguments": ',
        [],
    ),
]


def stream_tools(parser: ToolParser, chunks: list[str], max_calls: int | None = None):
    st = ToolStreamer(parser, max_calls)
    content, calls = "", {}
    for i, chunk in enumerate(chunks):
        c, deltas = st.feed(chunk, final=i == len(chunks) - 1)
        content += c
        for d in deltas:
            if d["index"] not in calls:  # the first delta of a call: id, type and name
                assert d["id"].startswith("chatcmpl-tool-") and d["type"] == "function"
                assert d["index"] == len(calls)
                calls[d["index"]] = [d["function"]["name"], ""]
            else:
                assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
            calls[d["index"]][1] += d["function"]["arguments"]
    return content or None, [tuple(calls[i]) for i in range(len(calls))]


@pytest.mark.parametrize("name,text,content,calls", TOOL_CASES)
def test_tool_parser_complete_and_streamed(name, text, content, calls):
    parser = TOOL_PARSERS[name]()
    got_content, got_calls = parser.extract(text)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    for args in (a for _, a in calls):
        json.loads(args)
    # Malformed only after a call's name was complete (cut short, trailing text): a stream
    # already sent the call; it stays sent (as in vLLM) and the text is not repeated as content.
    late = not calls and '"name": "f"' in text
    for chunks in chunkings(text):
        got = stream_tools(parser, chunks)
        if late:
            assert got == (content, []) or got[0] is None and got[1][0][0] == "f"
        else:
            assert got == (content, calls), chunks


# Every format's calls, well-formed and broken, one after another: model output no parser
# may raise on, streamed in any chunking (a malformed block before a later one included)
MIXED = [
    'a <tool_call>{"name": 1}</tool_call> x <tool_call>{"name": "f", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": {}} junk</tool_call><tool_call>{"name": "g"',
    '[TOOL_CALLS][{"name": "f", "arguments": {"a": [1, }}] <tool_call>{"name": "g", "arg',
    '{"name": "f", "parameters": {"x": 1}}; {"name": 2} [f(a=1), g(b=[1, 2)] tail',
    'functools[{"name": "f", "arguments": {}}, {"name"] <function=f><parameter=x>1</function>',
    "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n<tool_call><function=g>",
]


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_no_parser_raises_on_mixed_or_broken_calls(name):
    for text in MIXED:
        TOOL_PARSERS[name]().extract(text)
        for chunks in chunkings(text, rounds=10):
            stream_tools(TOOL_PARSERS[name](), chunks)


def test_stream_sends_name_first_then_argument_fragments():
    text = f'<tool_call>{{"name": "get_weather", "arguments": {WEATHER}}}</tool_call>'
    st = ToolStreamer(TOOL_PARSERS["hermes"]())
    deltas = [d for ch in text for d in st.feed(ch)[1]] + st.feed("", final=True)[1]
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": ""}
    frags = [d["function"]["arguments"] for d in deltas[1:]]
    assert len(frags) > 5 and "".join(frags) == WEATHER  # fragments as they arrive


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = '[TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]'
    assert stream_tools(TOOL_PARSERS["mistral"](), list(text), max_calls=1) == (None, [("a", "{}")])


def test_required_and_named_outputs():
    text = f' [{{"name": "get_weather", "parameters": {WEATHER}}}, '
    text += '{"name": "f", "parameters": {}}]'
    want = (None, [("get_weather", WEATHER), ("f", "{}")])
    for chunks in chunkings(text):
        assert stream_tools(RequiredToolParser(), chunks) == want
    assert RequiredToolParser().extract('[{"name": "f", "para')[1] == []  # cut short: no calls
    for chunks in chunkings(WEATHER):
        assert stream_tools(NamedToolParser("get_weather"), chunks) == (
            None,
            [("get_weather", WEATHER)],
        )


# (parser, prompt, text, reasoning, content)
REASONING_CASES = [
    (
        "deepseek_r1",
        "",
        "<think>\nLet me think.\n</think>\n\nIt is 4.",
        "\nLet me think.\n",
        "\n\nIt is 4.",
    ),
    ("deepseek_r1", "<think>\n", "Hmm, 2+2.</think>4", "Hmm, 2+2.", "4"),
    ("deepseek_r1", "", "Still thinking when cut <", "Still thinking when cut <", None),
    (
        "qwen3",
        "<|im_start|>assistant\n",
        "<think>\nA < b </thi</think>\n\nDone",
        "\nA < b </thi",
        "\n\nDone",
    ),
    (
        "qwen3",
        "<|im_start|>assistant\n",
        "Just an answer, no <think> here",
        None,
        "Just an answer, no <think> here",
    ),
    ("qwen3", "<|im_start|>assistant\n<think>\n", "reasoning</think>answer", "reasoning", "answer"),
    (
        "qwen3",
        "<|im_start|>assistant\n<think>\n\n</think>\n\n",
        "<think>literal</think>x",
        None,
        "<think>literal</think>x",
    ),  # thinking disabled by the template
]


@pytest.mark.parametrize("name,prompt,text,reasoning,content", REASONING_CASES)
def test_reasoning_parser_complete_and_streamed(name, prompt, text, reasoning, content):
    parser = REASONING_PARSERS[name](prompt)
    assert parser.extract(text) == (reasoning, content)
    for chunks in chunkings(text):
        st, r, c = ReasoningStreamer(parser), "", ""
        for i, chunk in enumerate(chunks):
            dr, dc = st.feed(chunk, final=i == len(chunks) - 1)
            r, c = r + dr, c + dc
        assert (r or None, c or None) == (reasoning, content), chunks


def test_reasoning_then_tool_calls_streamed():
    """A reasoning parser's content feeds the tool parser, as the server chains them."""
    text = f'<think>call it</think>\n<tool_call>{{"name": "f", "arguments": {WEATHER}}}</tool_call>'
    for chunks in chunkings(text):
        rs, r = ReasoningStreamer(REASONING_PARSERS["qwen3"]("")), ""
        ts = ToolStreamer(TOOL_PARSERS["hermes"]())
        calls: dict[int, list[str]] = {}
        content = ""
        for i, chunk in enumerate(chunks):
            final = i == len(chunks) - 1
            dr, dc = rs.feed(chunk, final)
            c, deltas = ts.feed(dc, final)
            r, content = r + dr, content + c
            for d in deltas:
                calls.setdefault(d["index"], [d["function"].get("name"), ""])
                calls[d["index"]][1] += d["function"]["arguments"]
        assert (r, content, calls) == ("call it", "", {0: ["f", WEATHER]})
