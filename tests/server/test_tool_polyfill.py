"""Chat templates that ignore tools (paged.engine.chat_render): the default model's template
(SmolLM2) drops `tools` and assistant `tool_calls`, so they are written into the messages in
the tool parser's format; a template that renders them is applied exactly as before."""

from __future__ import annotations

import json

import pytest
from tool_model import TEMPLATE as QWEN_TEMPLATE
from tool_model import TIME_TOOL, WEATHER_TOOL

from paged.engine.chat_render import TOOL_FORMATS, apply_chat_template, template_caps

ARGS = {"city": "Paris", "unit": "celsius"}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}
ROUND_TRIP = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'  # noqa: E501
# renders system, user and assistant messages only (no tools, calls or tool results)
BARE = ("{% for m in messages %}{% if m.role != 'tool' %}<|im_start|>{{ m.role }}\n"
        "{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # fmt: skip
NO_SYSTEM = BARE.replace("m.role != 'tool'", "m.role in ['user', 'assistant']")


@pytest.fixture(scope="module")
def tok():
    from paged.model.loader import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(None))  # SmolLM2-135M-Instruct's, from its GGUF


def render(tok, conv, **kw):
    return apply_chat_template(tok, conv, add_generation_prompt=True, **kw)


def test_default_template_gets_tools_and_calls_in_the_messages(tok):
    caps = template_caps(tok, tok.chat_template)
    # it renders system messages, and role "tool" as a turn of its own
    assert (caps.system, caps.tools, caps.tool_calls, caps.tool_responses) == (
        True, False, False, True)  # fmt: skip
    plain = tok.apply_chat_template(ROUND_TRIP[:1], tokenize=False, add_generation_prompt=True)
    assert render(tok, ROUND_TRIP[:1]) == plain  # nothing to add: as before
    text = render(tok, ROUND_TRIP, tools=[WEATHER_TOOL, TIME_TOOL])
    assert text.startswith("<|im_start|>system\n# Tools\n")  # a system message of its own
    assert f"<tools>\n{json.dumps(WEATHER_TOOL)}\n{json.dumps(TIME_TOOL)}\n</tools>" in text
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}' in text
    assert f"<|im_start|>assistant\n{HERMES_CALL}<|im_end|>\n" in text
    assert "<|im_start|>tool\nsunny, 21 C<|im_end|>\n<|im_start|>assistant\n" in text
    # an existing system message keeps its text first; content before the calls stays
    conv = [{"role": "system", "content": "Be brief."}, *ROUND_TRIP]
    call = {**CALL, "function": {"name": "get_weather", "arguments": json.dumps(ARGS)}}
    conv[2] = {**conv[2], "content": "Let me look.", "tool_calls": [call]}
    text = render(tok, conv, tools=[WEATHER_TOOL])
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert text.count("<|im_start|>system") == 1
    assert f"<|im_start|>assistant\nLet me look.\n{HERMES_CALL}<|im_end|>" in text
    assert conv[2]["tool_calls"]  # the caller's messages are left alone
    # another parser's format
    text = render(tok, ROUND_TRIP, tools=[WEATHER_TOOL], tool_parser="llama3_json")
    assert '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}' in text


def test_a_template_with_tools_renders_as_before(tok):
    caps = template_caps(tok, QWEN_TEMPLATE)
    assert caps.tools and caps.tool_calls and caps.tool_responses
    convs = [ROUND_TRIP, [{"role": "system", "content": "Be brief."}, *ROUND_TRIP]]
    for conv in convs:
        for tools in (None, [WEATHER_TOOL, TIME_TOOL]):
            for parser in (None, "pythonic"):
                got = render(tok, conv, tools=tools, chat_template=QWEN_TEMPLATE,
                             tool_parser=parser, enable_thinking=False)  # fmt: skip
                want = tok.apply_chat_template(
                    conv, tools=tools, tokenize=False, add_generation_prompt=True,
                    chat_template=QWEN_TEMPLATE, enable_thinking=False,
                )  # fmt: skip
                assert got == want


def test_tool_results_and_templates_without_system_messages(tok):
    conv = [*ROUND_TRIP, {**ROUND_TRIP[2], "content": "windy"}]
    text = render(tok, conv, tools=[WEATHER_TOOL], chat_template=BARE)
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert ("<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response>\n"
            "<tool_response>\nwindy\n</tool_response><|im_end|>\n") in text  # fmt: skip
    conv = [{"role": "system", "content": "Be brief."}, *ROUND_TRIP]
    text = render(tok, conv, tools=[WEATHER_TOOL], chat_template=NO_SYSTEM)
    assert text.startswith("<|im_start|>user\n# Tools\n")  # in the first user message
    assert "</tool_call>\n\nWeather in Paris?<|im_end|>" in text


@pytest.mark.parametrize("name", sorted(TOOL_FORMATS))
def test_every_format_reads_back_with_its_parser(name):
    from paged.server.tool_parsers import TOOL_PARSERS

    assert set(TOOL_FORMATS) == set(TOOL_PARSERS)
    calls = [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"utc_offset": 2})]
    text = TOOL_FORMATS[name].calls(calls)
    content, drafts = TOOL_PARSERS[name]([WEATHER_TOOL, TIME_TOOL]).extract(text)
    assert content is None
    assert [(d.name, json.loads(d.arguments)) for d in drafts] == calls


def test_llm_chat_renders_through_it(tok):
    from paged import LLM

    llm = LLM.__new__(LLM)  # no engine: the prompts _run would get
    llm.tokenizer, llm.chat_template = tok, None
    llm._run = lambda prompts, *args: prompts
    [(text, ids)] = llm.chat(ROUND_TRIP, tools=[WEATHER_TOOL])
    assert text == render(tok, ROUND_TRIP, tools=[WEATHER_TOOL]) and HERMES_CALL in text


def test_tokenize_shows_the_tools_to_the_default_model(http):
    call = {**CALL, "function": {"name": "get_weather", "arguments": json.dumps(ARGS)}}
    msgs = [ROUND_TRIP[0], {"role": "assistant", "content": None, "tool_calls": [call]}]
    bare = http.post("/tokenize", json={"messages": msgs}).json()["tokens"]
    ids = http.post("/tokenize", json={"messages": msgs, "tools": [WEATHER_TOOL]}).json()["tokens"]
    assert ids != bare and len(ids) > len(bare)
    text = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert f"<tools>\n{json.dumps(WEATHER_TOOL)}\n</tools>" in text
    assert HERMES_CALL in text
