"""The outputs of tool_choice "required" and a named function, which structured outputs
constrain (vLLM's shapes): a JSON array of `{"name": ..., "parameters": {...}}`, or the named
function's arguments object itself."""

from __future__ import annotations

from paged.server.tool_parsers.base import Parsed, ToolParser
from paged.server.tool_parsers.json_scan import CallDraft, Invalid, scan_call_array, skip_ws


class RequiredToolParser(ToolParser):
    name = "required"

    def parse(self, text: str, final: bool) -> Parsed:
        try:
            calls, end = scan_call_array(text, 0, final)
            if end is not None and skip_ws(text, end) != len(text):
                raise Invalid
        except Invalid:  # cut short (finish_reason length): the text, no calls
            return Parsed(text) if final else Parsed()
        return Parsed("", calls)


class NamedToolParser(ToolParser):
    """The whole output is the arguments of the one function named by tool_choice; as in
    vLLM it is passed on as generated (a cut-short output is not valid JSON)."""

    name = "named"

    def __init__(self, function: str) -> None:
        self.function = function

    def parse(self, text: str, final: bool) -> Parsed:
        return Parsed("", [CallDraft(self.function, text, final)])
