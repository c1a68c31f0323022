"""mistral: content, then `[TOOL_CALLS]` and a JSON array of `{"name": ..., "arguments":
{...}}`. `[TOOL_CALLS]` is a special token of Mistral's tokenizers: the server keeps special
tokens in the text of such requests (as vLLM does)."""

from __future__ import annotations

from paged.server.tool_parsers.base import Parsed, ToolParser, split_tagged
from paged.server.tool_parsers.json_scan import WS, Invalid, scan_call_array

TOOL_CALLS = "[TOOL_CALLS]"


class MistralToolParser(ToolParser):
    name = "mistral"
    special_tags = (TOOL_CALLS,)

    def parse(self, text: str, final: bool) -> Parsed:
        content, body = split_tagged(text, TOOL_CALLS, final)
        if body is None:
            return Parsed(content)
        try:
            calls, end = scan_call_array(body, 0, final)
        except Invalid:
            return Parsed(text) if final else Parsed(content)
        if end is not None:  # text after the array
            content += body[end:].lstrip(WS)
        return Parsed(content, calls)
