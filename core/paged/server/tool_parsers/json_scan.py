"""Scanning JSON tool calls that may still be arriving.

The parsers read the raw text of each call's arguments straight out of the model's output, so
a streamed call's argument fragments join up to exactly the non-streamed arguments. Only the
extent of values is scanned here; a finished call is then checked with json.loads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

WS = " \t\r\n"
ARGUMENT_KEYS = ("arguments", "parameters")


class Incomplete(Exception):
    """The text ends inside the value."""


class Invalid(Exception):
    """The text cannot be the JSON expected here."""


@dataclass
class CallDraft:
    """A tool call as far as it is known."""

    name: str | None = None  # known once its string is closed
    arguments: str = ""  # raw JSON text of the arguments known so far (a prefix of the final)
    done: bool = False  # the call's object is closed and valid


def skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in WS:
        i += 1
    return i


def scan_string(s: str, i: int) -> int:
    """End (exclusive) of the string starting at s[i] == '"'."""
    i += 1
    while i < len(s):
        c = s[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    raise Incomplete


def scan_value(s: str, i: int) -> int:
    """End (exclusive) of the JSON value starting at s[i]."""
    if i >= len(s):
        raise Incomplete
    c = s[i]
    if c == '"':
        return scan_string(s, i)
    if c in "{[":
        depth = 0
        while i < len(s):
            c = s[i]
            if c == '"':
                i = scan_string(s, i)
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        raise Incomplete
    j = i
    while j < len(s) and (s[j].isalnum() or s[j] in "+-."):
        j += 1
    if j == i:
        raise Invalid
    if j == len(s):
        raise Incomplete  # a number or literal may go on
    return j


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def scan_call(s: str, i: int, final: bool) -> tuple[CallDraft, int | None]:
    """The call object starting at s[i] (after whitespace) and the index after it (None when
    it is not closed yet). Raises Invalid when it cannot be a call, or when `final` and the
    object is unfinished."""
    i = skip_ws(s, i)
    draft = CallDraft()
    if i >= len(s):
        if final:
            raise Invalid
        return draft, None
    if s[i] != "{":
        raise Invalid
    start, j = i, i + 1
    args_span: tuple[int, int | None] | None = None
    try:
        while True:
            j = skip_ws(s, j)
            if j >= len(s):
                raise Incomplete
            if s[j] == "}":
                j += 1
                break
            if s[j] == ",":
                j = skip_ws(s, j + 1)
            if j >= len(s):
                raise Incomplete
            if s[j] != '"':
                raise Invalid
            k_end = scan_string(s, j)
            try:
                key = json.loads(s[j:k_end])
            except ValueError:
                raise Invalid from None
            j = skip_ws(s, k_end)
            if j >= len(s):
                raise Incomplete
            if s[j] != ":":
                raise Invalid
            v = skip_ws(s, j + 1)
            if key in ARGUMENT_KEYS and args_span is None:
                args_span = (v, None)
            end = scan_value(s, v)
            if key == "name" and draft.name is None:
                try:
                    draft.name = json.loads(s[v:end])
                except ValueError:
                    raise Invalid from None
            elif args_span is not None and args_span[0] == v:
                args_span = (v, end)
            j = end
    except Incomplete:
        if final:
            raise Invalid from None
        if args_span is not None and args_span[0] < len(s) and s[args_span[0]] == "{":
            # closed: its own text; still open: all the text so far belongs to it
            draft.arguments = s[args_span[0] : args_span[1]]
        if not isinstance(draft.name, str):
            draft.name = None
        return draft, None
    try:
        obj = json.loads(s[start:j])
    except ValueError:
        raise Invalid from None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise Invalid
    if args_span is None:
        draft.arguments = "{}"
    else:
        if not isinstance(json.loads(s[args_span[0] : args_span[1]]), dict):
            raise Invalid
        draft.arguments = s[args_span[0] : args_span[1]]
    draft.done = True
    return draft, j


def scan_call_array(s: str, i: int, final: bool) -> tuple[list[CallDraft], int | None]:
    """A JSON array of call objects starting at s[i] (after whitespace): the calls and the
    index after the array (None when it is not closed yet)."""
    i = skip_ws(s, i)
    calls: list[CallDraft] = []
    if i >= len(s):
        if final:
            raise Invalid
        return calls, None
    if s[i] != "[":
        raise Invalid
    j = skip_ws(s, i + 1)
    if j < len(s) and s[j] == "]":
        raise Invalid  # no calls at all
    while True:
        draft, end = scan_call(s, j, final)
        calls.append(draft)
        if end is None:
            return calls, None
        j = skip_ws(s, end)
        if j >= len(s):
            if final:
                raise Invalid
            return calls, None
        if s[j] == "]":
            return calls, j + 1
        if s[j] != ",":
            raise Invalid
        j += 1
