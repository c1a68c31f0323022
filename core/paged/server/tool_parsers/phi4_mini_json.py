"""phi4_mini_json: Phi-4-mini's `functools[{"name": ..., "arguments": {...}}, ...]`, a JSON
array of calls right after the word `functools`; text before it (and after the array) is
content. `functools` not followed by `[` is plain text."""

from __future__ import annotations

from paged.server.tool_parsers.base import Parsed, ToolParser, split_tagged
from paged.server.tool_parsers.json_scan import WS, Invalid, scan_call_array

TAG = "functools["


class Phi4MiniJsonToolParser(ToolParser):
    name = "phi4_mini_json"

    def parse(self, text: str, final: bool) -> Parsed:
        content, body = split_tagged(text, TAG, final)
        if body is None:
            return Parsed(content)
        try:
            calls, end = scan_call_array("[" + body, 0, final)  # the tag holds the `[`
        except Invalid:
            return Parsed(text) if final else Parsed(content)
        if end is not None:  # text after the array
            after = body[end - 1 :].lstrip(WS)
            content += "\n\n" + after if content and after else after
        return Parsed(content, calls)
