"""pythonic: the whole output is a Python list of calls with keyword arguments,
`[get_weather(city="Paris"), get_time()]`, as Llama 3.2 and Llama 4 write them (Llama 4 may
wrap it in `<|python_start|>`...`<|python_end|>`). Values are Python literals, read with `ast`
(never evaluated) and sent as JSON. An output that is not such a list is content.

Streaming holds the output back while it can still be a call list; a call's name goes out at
its `(`, each argument as its value ends (at `,` or `)`), and `}` at the call's `)`."""

from __future__ import annotations

import ast
import json
import math
from keyword import iskeyword
from typing import Any

from paged.server.tool_parsers.base import Parsed, ToolParser
from paged.server.tool_parsers.json_scan import WS, CallDraft, Incomplete, Invalid, skip_ws

START, END = "<|python_start|>", "<|python_end|>"
JSON_NAMES = {"true": True, "false": False, "null": None}  # JSON spellings, tolerated


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def parse(self, text: str, final: bool) -> Parsed:
        body = text.lstrip(WS)
        if not final and START.startswith(body):
            return Parsed()  # nothing yet, or the start of the wrapper
        if body.startswith(START):
            body = body[len(START) :].lstrip(WS)
            if not final and not body:
                return Parsed()
        if not body.startswith("["):
            return Parsed(text)
        try:
            return Parsed("", scan_calls(body, final))
        except Invalid:  # not a call list after all (a stream that sent calls keeps them)
            return Parsed(text)


def need(s: str, i: int) -> None:
    if i >= len(s):
        raise Incomplete


def scan_calls(s: str, final: bool) -> list[CallDraft]:
    """The calls of the list `s` (starting with `[`), as far as they are known."""
    calls: list[CallDraft] = []
    try:
        i = skip_ws(s, 1)
        need(s, i)
        if s[i] == "]":
            raise Invalid  # no calls
        while True:
            i = skip_ws(s, scan_call(s, i, calls))
            need(s, i)
            if s[i] == ",":
                i = skip_ws(s, i + 1)
                need(s, i)
                if s[i] != "]":
                    continue
            elif s[i] != "]":
                raise Invalid
            break
        tail = s[i + 1 :].strip(WS)
        if tail not in ("", END) and (final or not END.startswith(tail)):
            raise Invalid  # text after the list
    except Incomplete:
        if final:
            raise Invalid from None
    return calls


def identifier_end(s: str, i: int) -> int:
    while i < len(s) and (s[i].isalnum() or s[i] == "_"):
        i += 1
    if i == len(s):
        raise Incomplete  # the name may go on
    return i


def scan_call(s: str, i: int, calls: list[CallDraft]) -> int:
    """Scans `name(k=v, ...)` at s[i]; appends its draft once the name is known and returns
    the index after the `)`."""
    j = identifier_end(s, i)
    name = s[i:j]
    if not name.isidentifier() or iskeyword(name):
        raise Invalid
    j = skip_ws(s, j)
    need(s, j)
    if s[j] != "(":
        raise Invalid
    draft = CallDraft(name, "{")
    calls.append(draft)
    keys: set[str] = set()
    j = skip_ws(s, j + 1)
    while True:
        need(s, j)
        if s[j] == ")":
            break
        k = identifier_end(s, j)
        key = s[j:k]
        if not key.isidentifier() or iskeyword(key) or key in keys:
            raise Invalid  # positional or repeated arguments, too
        k = skip_ws(s, k)
        need(s, k)
        if s[k] != "=":
            raise Invalid
        v = skip_ws(s, k + 1)
        end = value_end(s, v)
        item = json.dumps(key) + ": " + json.dumps(literal(s[v:end]), ensure_ascii=False)
        draft.arguments += (", " if keys else "") + item
        keys.add(key)
        j = skip_ws(s, end + 1) if s[end] == "," else end
    draft.arguments += "}"
    draft.done = True
    return j + 1


def value_end(s: str, i: int) -> int:
    """Index of the `,` or `)` that ends the argument value starting at s[i]."""
    depth = 0
    while i < len(s):
        c = s[i]
        if c in "'\"":
            i = string_end(s, i)
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            if depth == 0:
                if c == ")":
                    return i
                raise Invalid
            depth -= 1
        elif c == "," and depth == 0:
            return i
        i += 1
    raise Incomplete


def string_end(s: str, i: int) -> int:
    """End (exclusive) of the Python string whose quote is at s[i] (single or triple)."""
    q = s[i]
    triple = s.startswith(q * 3, i)
    i += 3 if triple else 1
    while i < len(s):
        if s[i] == "\\":
            i += 2
        elif triple and s.startswith(q * 3, i):
            return i + 3
        elif not triple and s[i] == q:
            return i + 1
        elif not triple and s[i] == "\n":
            raise Invalid
        else:
            i += 1
    raise Incomplete


def literal(src: str) -> Any:
    """The JSON value of a Python literal's source."""
    try:
        return to_json(ast.parse(src.strip(WS), mode="eval").body)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        raise Invalid from None


def to_json(n: ast.expr) -> Any:
    if isinstance(n, ast.Constant):
        v = n.value
        if v is None or isinstance(v, (str, bool, int)):
            return v
        if isinstance(v, float) and math.isfinite(v):
            return v
    elif isinstance(n, ast.UnaryOp) and isinstance(n.op, (ast.USub, ast.UAdd)):
        v = to_json(n.operand)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return -v if isinstance(n.op, ast.USub) else v
    elif isinstance(n, (ast.List, ast.Tuple)):
        return [to_json(e) for e in n.elts]
    elif isinstance(n, ast.Dict):
        out: dict[Any, Any] = {}
        for k, v in zip(n.keys, n.values):
            key = None if k is None else to_json(k)  # None: a `**spread`
            if k is None or isinstance(key, (list, dict)):
                raise Invalid  # scalar keys only (json.dumps makes them strings)
            out[key] = to_json(v)
        return out
    elif isinstance(n, ast.Name) and n.id in JSON_NAMES:
        return JSON_NAMES[n.id]
    raise Invalid
