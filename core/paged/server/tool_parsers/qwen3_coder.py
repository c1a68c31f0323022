"""qwen3_coder: Qwen3-Coder's XML calls, any number, text around them is content:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Values are raw text (one newline after `>` and before `</parameter>` is layout) and take the
JSON type the request's tool schema declares for the parameter (see `convert`). A parameter
also ends at the next `<parameter=` or `</function>`, a function at `</tool_call>` (as vLLM).
Streaming sends a call's name at `<function=NAME>`, then `{`, each parameter as it ends and `}`.
"""

from __future__ import annotations

import ast
import json
import math
from collections.abc import Sequence
from typing import Any

from paged.server.tool_parsers.base import TaggedBlockParser
from paged.server.tool_parsers.json_scan import WS, CallDraft, Invalid, skip_ws

START, END = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
VALUE_ENDS = (PARAMETER_END, PARAMETER, FUNCTION_END, END)


class Qwen3CoderToolParser(TaggedBlockParser):
    name = "qwen3_coder"
    START, END = START, END

    def scan_block(self, s: str, final: bool) -> tuple[CallDraft, int | None]:
        """The `<function=...>` block at the start of `s` (after whitespace) and the index
        after it (None while it is open; `final` and open raises Invalid)."""
        draft = CallDraft()
        i = skip_ws(s, 0)
        if not s.startswith(FUNCTION, i):
            if final or not FUNCTION.startswith(s[i:]):
                raise Invalid
            return draft, None
        name, i = tag_value(s, i + len(FUNCTION))
        if name is None:
            return open_end(draft, final)
        draft.name, draft.arguments = name, "{"
        properties = tool_properties(self.tools, name)
        seen: set[str] = set()
        while True:
            i = skip_ws(s, i)
            if s.startswith(FUNCTION_END, i) or s.startswith(END, i):  # `END`: left to _parse
                draft.arguments += "}"
                draft.done = True
                return draft, i + len(FUNCTION_END) if s.startswith(FUNCTION_END, i) else i
            if not s.startswith(PARAMETER, i):
                rest = s[i:]
                if not final and any(t.startswith(rest) for t in (PARAMETER, FUNCTION_END, END)):
                    return open_end(draft, final)
                raise Invalid  # stray text between parameters
            key, v = tag_value(s, i + len(PARAMETER))
            if key is None:
                return open_end(draft, final)
            ends = [(j, t) for t in VALUE_ENDS if (j := s.find(t, v)) >= 0]
            if not ends:
                return open_end(draft, final)
            end, tag = min(ends)
            raw = s[v:end].removeprefix("\n").removesuffix("\n")
            if key not in seen:  # a repeated parameter: the first one counts
                value = convert(raw, properties.get(key))
                item = json.dumps(key, ensure_ascii=False) + ": "
                draft.arguments += (", " if seen else "") + item
                draft.arguments += json.dumps(value, ensure_ascii=False)
                seen.add(key)
            i = end + len(PARAMETER_END) if tag == PARAMETER_END else end


def open_end(draft: CallDraft, final: bool) -> tuple[CallDraft, None]:
    if final:
        raise Invalid  # cut short inside the call
    return draft, None


def tag_value(s: str, i: int) -> tuple[str | None, int]:
    """The name in `<function=NAME>` / `<parameter=NAME>` from s[i] and the index after `>`
    (None while the `>` has not arrived)."""
    j = s.find(">", i)
    if j < 0:
        if "<" in s[i:] or "\n" in s[i:]:
            raise Invalid
        return None, i
    name = s[i:j].strip(WS)
    if not name or "<" in name or "\n" in name:
        raise Invalid
    return name, j + 1


def tool_properties(tools: Sequence[Any] | None, name: str) -> dict[str, Any]:
    """The `properties` of the named tool's parameters schema (request models or dicts)."""
    for t in tools or ():
        fn = field(t, "function")
        if field(fn, "name") == name:
            props = field(field(fn, "parameters") or {}, "properties")
            return props if isinstance(props, dict) else {}
    return {}


def field(obj: Any, key: str) -> Any:
    return obj.get(key) if isinstance(obj, dict) else getattr(obj, key, None)


def schema_types(schema: Any) -> set[str]:
    if not isinstance(schema, dict):
        return set()
    t = schema.get("type")
    types = {t} if isinstance(t, str) else set()
    if isinstance(t, list):
        types = {x for x in t if isinstance(x, str)}
    for sub in [*(schema.get("anyOf") or ()), *(schema.get("oneOf") or ())]:
        types |= schema_types(sub)
    return types


def convert(raw: str, schema: Any) -> Any:
    """A parameter's raw text as the type its schema declares: a string parameter (or one
    without a declared type) stays text; otherwise the text read as JSON (else as a Python
    literal, never evaluated) when it gives that type ("null" gives null), else the text."""
    types = schema_types(schema)
    if not types or "string" in types:
        return raw
    s = raw.strip(WS)
    if s.lower() in ("true", "false") and "boolean" in types:
        return s.lower() == "true"
    if s.lower() in ("null", "none"):
        return None  # as vLLM, whatever the type
    try:
        value = json.loads(s)
    except ValueError:
        try:
            value = ast.literal_eval(s)
        except Exception:  # SyntaxError, ValueError, MemoryError, RecursionError, ...
            return raw
    value = typed(value, types)
    try:
        json.dumps(value)  # Python literals can hold what JSON cannot (sets, tuple keys)
    except (TypeError, ValueError):
        return raw
    return raw if value is None else value


def typed(v: Any, types: set[str]) -> Any:
    """`v` when it is one of the JSON `types` (an integral float counts as an integer)."""
    if isinstance(v, bool):
        return v if "boolean" in types else None
    if isinstance(v, int):
        return v if types & {"integer", "number"} else None
    if isinstance(v, float):
        if not math.isfinite(v):
            return None
        if "number" in types:
            return v
        return int(v) if "integer" in types and v.is_integer() else None
    if isinstance(v, (list, tuple)):
        return list(v) if "array" in types else None
    if isinstance(v, dict):
        return v if "object" in types else None
    return None
