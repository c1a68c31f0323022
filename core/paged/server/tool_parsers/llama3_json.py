"""llama3_json: Llama 3.x JSON calls, `{"name": ..., "parameters": {...}}`, several joined by
`;`, optionally after `<|python_tag|>`. An output that does not start with a call is content."""

from __future__ import annotations

from paged.server.tool_parsers.base import Parsed, ToolParser
from paged.server.tool_parsers.json_scan import WS, Invalid, scan_call, skip_ws

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def parse(self, text: str, final: bool) -> Parsed:
        body = text.lstrip(WS)
        if not final and PYTHON_TAG.startswith(body):
            return Parsed()  # nothing, or the start of the tag: not known yet
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG) :]
            if not final and not body.strip(WS):
                return Parsed()
        if not body.lstrip(WS).startswith("{"):
            return Parsed(text)
        try:
            return Parsed("", self._calls(body, final))
        except Invalid:
            return Parsed(text) if final else Parsed()

    @staticmethod
    def _calls(s: str, final: bool) -> list:
        calls, i = [], 0
        while True:
            draft, end = scan_call(s, i, final)
            calls.append(draft)
            if end is None:
                return calls
            i = skip_ws(s, end)
            if i == len(s):
                return calls
            if s[i] != ";":
                raise Invalid
            i += 1
            if skip_ws(s, i) == len(s):  # a trailing separator
                return calls
