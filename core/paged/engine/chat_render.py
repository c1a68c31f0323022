"""Chat templates that ignore tools: llama.cpp's template polyfills (minja's capabilities,
common/chat.cpp) around transformers' `apply_chat_template`.

A template's capabilities are probed once per template string: a probe conversation is
rendered with and without tools, with an assistant `tool_calls` message, a `role: "tool"`
result and a system message, and each is supported when its marker text shows in the output.
Where the template lacks one that a conversation uses, the conversation is rewritten before
rendering, in the format of the tool-call parser that will read the output (hermes when there
is none or it is unknown):

- `tools`: described in the system message (after its content, or as a new system message;
  at the start of the first user message when the template drops system messages), with the
  instruction to call them in the parser's format;
- assistant `tool_calls`: written into the message's content in that format;
- tool results: a user message wrapping each in `<tool_response>...</tool_response>`
  (consecutive results in one message, as Qwen's templates do).

A conversation that uses nothing its template lacks gets the very call it got before: the
prompt is byte-identical (a plain chat probes nothing).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# ---- capabilities ------------------------------------------------------------------------


@dataclass(frozen=True)
class TemplateCaps:
    system: bool  # a system message's content shows
    tools: bool  # the `tools` argument shows
    tool_calls: bool  # an assistant message's tool_calls show (name and arguments)
    tool_responses: bool  # a role "tool" message's content shows


_CAPS: dict[str, TemplateCaps] = {}  # by template string (a race only probes twice)

_USER = {"role": "user", "content": "paged_probe_question"}
_TOOL = {"type": "function", "function": {
    "name": "paged_probe_tool", "description": "A probe.",
    "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}  # fmt: skip
# a 9-character id: Mistral's templates raise on any other
_CALL = {"id": "call12345", "type": "function", "function": {
    "name": "paged_probe_call", "arguments": {"paged_probe_argument": "1"}}}  # fmt: skip
_CALLING = {"role": "assistant", "content": "", "tool_calls": [_CALL]}
_RESULT = {"role": "tool", "tool_call_id": "call12345", "name": "paged_probe_call",
           "content": "paged_probe_result"}  # fmt: skip


def template_caps(tok: Any, template: str) -> TemplateCaps:
    """What `template` renders (probed once per template string, with `tok`'s variables)."""
    caps = _CAPS.get(template)
    if caps is None:
        caps = _CAPS[template] = _probe(tok, template)
    return caps


def _probe(tok: Any, template: str) -> TemplateCaps:
    def render(messages: list[dict], tools: list | None = None) -> str:
        try:
            return tok.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=False,
                chat_template=template,
            )  # fmt: skip
        except Exception:  # raise_exception(...) or a template error: not supported
            return ""

    system = render([{"role": "system", "content": "paged_probe_system"}, _USER])
    called = render([_USER, _CALLING])
    answered = {"role": "assistant", "content": "paged_probe_answer"}
    return TemplateCaps(
        system="paged_probe_system" in system,
        tools="paged_probe_tool" in render([_USER], [_TOOL]),
        tool_calls="paged_probe_call" in called and "paged_probe_argument" in called,
        tool_responses=any(
            "paged_probe_result" in render([_USER, a, _RESULT]) for a in (_CALLING, answered)
        ),
    )


# ---- the parsers' formats ------------------------------------------------------------------


def _dumps(x: Any, indent: int | None = None) -> str:
    return json.dumps(x, ensure_ascii=False, indent=indent)  # as the templates' tojson


Calls = list[tuple[str, Any]]  # (name, arguments: a mapping, or the text when not JSON)


@dataclass(frozen=True)
class ToolFormat:
    describe: Callable[[list[dict]], str]  # the tools, and how to call them
    calls: Callable[[Calls], str]  # an assistant's calls, as the parser reads them


def _hermes_describe(tools: list[dict]) -> str:  # Qwen2.5's words
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + "\n".join(_dumps(t) for t in tools)
        + "\n</tools>\n\nFor each function call, return a json object with function name and "
        "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def _hermes_call(name: str, args: Any) -> str:
    return f"<tool_call>\n{_dumps({'name': name, 'arguments': args})}\n</tool_call>"


def _hermes_calls(calls: Calls) -> str:
    return "\n".join(_hermes_call(n, a) for n, a in calls)


def _llama3_describe(tools: list[dict]) -> str:  # Llama 3.1's words
    return (
        "Given the following functions, please respond with a JSON for a function call with its "
        "proper arguments that best answers the given prompt.\n\nRespond in the format "
        '{"name": function name, "parameters": dictionary of argument name and its value}. '
        "Do not use variables.\n\n" + "\n\n".join(_dumps(t, 4) for t in tools)
    )


def _llama3_calls(calls: Calls) -> str:
    return "; ".join(_dumps({"name": n, "parameters": a}) for n, a in calls)


def _array_format(tag: str) -> ToolFormat:
    """`TAG[{"name": ..., "arguments": {...}}, ...]` (mistral, phi4_mini_json)."""

    def describe(tools: list[dict]) -> str:
        return (
            "You may call one or more of these functions (JSON signatures):\n"
            + _dumps(tools)
            + f"\n\nTo call functions, answer with {tag} followed by a JSON array of the calls:\n"
            f'{tag}[{{"name": <function-name>, "arguments": <args-json-object>}}]'
        )

    def calls(cs: Calls) -> str:
        return tag + _dumps([{"name": n, "arguments": a} for n, a in cs])

    return ToolFormat(describe, calls)


def _pythonic_describe(tools: list[dict]) -> str:  # Llama 3.2's words
    return (
        "You are an expert in composing functions. You are given a question and a set of "
        "possible functions. Based on the question, you will need to make one or more "
        "function/tool calls to achieve the purpose.\n\nIf you decide to invoke any of the "
        "function(s), you MUST put it in the format of [func_name1(params_name1=params_value1, "
        "params_name2=params_value2...), func_name2(params)]\nYou SHOULD NOT include any other "
        "text in the response.\n\nHere is a list of functions in JSON format that you can "
        "invoke.\n\n" + _dumps(tools, 4)
    )


def _pythonic_calls(calls: Calls) -> str:
    if not all(isinstance(a, dict) for _, a in calls):  # not keyword arguments: as hermes
        return _hermes_calls(calls)
    items = (f"{n}({', '.join(f'{k}={v!r}' for k, v in a.items())})" for n, a in calls)
    return "[" + ", ".join(items) + "]"  # JSON values: repr is a Python literal


def _coder_describe(tools: list[dict]) -> str:  # Qwen3-Coder's words
    return (
        "# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
        + "\n".join(_dumps(t) for t in tools)
        + "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format "
        "with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n"
        "<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>\n</tool_call>"
    )


def _coder_call(name: str, args: Any) -> str:
    if not isinstance(args, dict):
        return _hermes_call(name, args)
    params = "".join(
        f"<parameter={k}>\n{v if isinstance(v, str) else _dumps(v)}\n</parameter>\n"
        for k, v in args.items()
    )
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


HERMES = ToolFormat(_hermes_describe, _hermes_calls)
TOOL_FORMATS: dict[str, ToolFormat] = {  # by --tool-call-parser name
    "hermes": HERMES,
    "llama3_json": ToolFormat(_llama3_describe, _llama3_calls),
    "mistral": _array_format("[TOOL_CALLS]"),
    "phi4_mini_json": _array_format("functools"),
    "pythonic": ToolFormat(_pythonic_describe, _pythonic_calls),
    "qwen3_coder": ToolFormat(_coder_describe, lambda cs: "\n".join(_coder_call(*c) for c in cs)),
}


# ---- rendering -----------------------------------------------------------------------------


def apply_chat_template(
    tok: Any,
    conversation: list[dict],
    *,
    tools: list | None = None,
    chat_template: str | None = None,
    add_generation_prompt: bool = False,
    tool_parser: str | None = None,
    **kwargs: Any,
) -> str:
    """`tok.apply_chat_template(conversation, tools=tools, tokenize=False, ...)` (its errors
    too), with the tools, tool calls and tool results the template would drop written into the
    messages in `tool_parser`'s format (a --tool-call-parser name; hermes when None/unknown).
    `kwargs`: the template's variables (continue_final_message, enable_thinking, ...)."""
    roles = [m.get("role") for m in conversation]
    calls = any(r == "assistant" and m.get("tool_calls") for r, m in zip(roles, conversation))
    results = "tool" in roles
    if tools or calls or results:
        try:
            template = tok.get_chat_template(chat_template, tools)
        except Exception:  # no template: apply_chat_template says so below
            template = None
        if isinstance(template, str):
            caps = template_caps(tok, template)
            fill_tools = bool(tools) and not caps.tools
            calls = calls and not caps.tool_calls
            results = results and not caps.tool_responses
            if fill_tools or calls or results:
                fmt = TOOL_FORMATS.get(tool_parser or "hermes", HERMES)
                described = _tool_dicts(tools) if fill_tools else None
                conversation = polyfill(conversation, fmt, described, calls, results, caps.system)
                chat_template, tools = template, (None if fill_tools else tools)
    return tok.apply_chat_template(
        conversation,
        tools=tools,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        chat_template=chat_template,
        **kwargs,
    )


def polyfill(
    conversation: list[dict],
    fmt: ToolFormat,
    tools: list[dict] | None,
    calls: bool,
    results: bool,
    system: bool,
) -> list[dict]:
    """A copy of the conversation with `tools` described in it, assistant tool_calls in the
    content (`calls`) and tool results as user messages (`results`); `system`: whether the
    template shows system messages."""
    out: list[dict] = []
    merged = False  # out[-1] is tool results made a user message
    for m in conversation:
        role = m.get("role")
        if results and role == "tool":
            wrapped = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if merged:
                out[-1]["content"] += "\n" + wrapped
            else:
                out.append({"role": "user", "content": wrapped})
            merged = True
            continue
        merged = False
        if calls and role == "assistant" and m.get("tool_calls"):
            written = fmt.calls(_calls_of(m))
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            m["content"] = _append(m.get("content"), written, "\n")
        out.append(m)
    if tools:
        text = fmt.describe(tools)
        if system and out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": _append(out[0].get("content"), text, "\n\n")}
        elif system:
            out.insert(0, {"role": "system", "content": text})
        else:  # the template drops system messages: the first user message says it
            i = next((i for i, m in enumerate(out) if m.get("role") == "user"), None)
            if i is None:
                out.insert(0, {"role": "user", "content": text})
            else:
                out[i] = {**out[i], "content": _prepend(out[i].get("content"), text, "\n\n")}
    return out


def _calls_of(msg: dict) -> Calls:
    out = []
    for c in msg["tool_calls"]:
        f = c.get("function", c) if isinstance(c, dict) else {}
        args = f.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass  # kept as the text
        out.append((f.get("name", ""), args))
    return out


def _tool_dicts(tools: list) -> list[dict]:
    """The tools as JSON schemas (functions given offline: transformers' get_json_schema)."""
    if not any(callable(t) for t in tools):
        return list(tools)
    from transformers.utils import get_json_schema

    return [get_json_schema(t) if callable(t) else t for t in tools]


# Message contents are strings here: both callers join text parts first (the server's
# ChatMessage.as_template_input, llm_inputs.check_conversations).
def _append(content: str | None, text: str, sep: str) -> str:
    return f"{content}{sep}{text}" if content else text


def _prepend(content: str | None, text: str, sep: str) -> str:
    return f"{text}{sep}{content}" if content else text
