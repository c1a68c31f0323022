"""hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, as Qwen2.5,
Qwen3, Hermes and SmolLM2 write them; text outside the blocks is content."""

from __future__ import annotations

from paged.server.tool_parsers.base import Parsed, ToolParser, split_tagged
from paged.server.tool_parsers.json_scan import WS, Invalid, scan_call, skip_ws

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def parse(self, text: str, final: bool) -> Parsed:
        try:
            return self._parse(text, final)
        except Invalid:
            if final:
                return Parsed(text)  # not a well-formed call: all of it is content
            return self._parse_before_invalid(text)

    def _parse(self, text: str, final: bool) -> Parsed:
        out = Parsed()
        rest: str | None = text
        while rest is not None:
            content, body = split_tagged(rest, START, final)
            if out.calls:  # whitespace right after a call separates; it is not content
                content = content.lstrip(WS)
                if content and out.content:  # text on both sides of calls: two paragraphs
                    content = "\n\n" + content
            out.content += content
            if body is None:
                break
            draft, end = scan_call(body, 0, final)  # the object decides where it ends
            out.calls.append(draft)
            if end is None:
                break
            j = skip_ws(body, end)
            if body.startswith(END, j):
                rest = body[j + len(END) :]
            elif j == len(body) or (not final and END.startswith(body[j:])):
                break  # an unclosed last block, or its end tag still arriving
            else:
                raise Invalid  # text after the object inside the block
        return out

    def _parse_before_invalid(self, text: str) -> Parsed:
        """While streaming, a malformed block: keep what was known before the first block
        that is malformed (the final parse will show the whole text as content)."""
        j = text.rfind(START)
        while j > 0:
            try:
                return self._parse(text[:j], False)
            except Invalid:  # an earlier block is malformed too
                j = text.rfind(START, 0, j)
        return Parsed()
