"""hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, as Qwen2.5,
Qwen3, Hermes and SmolLM2 write them; text outside the blocks is content."""

from __future__ import annotations

from paged.server.tool_parsers.base import TaggedBlockParser
from paged.server.tool_parsers.json_scan import CallDraft, scan_call


class HermesToolParser(TaggedBlockParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def scan_block(self, body: str, final: bool) -> tuple[CallDraft, int | None]:
        return scan_call(body, 0, final)  # the JSON object decides where it ends
