"""The tool-parser contract, and the streamer that turns any parser into OpenAI deltas.

A parser is a pure function of the text generated so far: `parse(text, final)` says which
content is safe to show and which calls are known. Streaming calls it on the growing text and
sends what is new, so the deltas of a stream join up to exactly the non-streamed message
(for any chunking of the text), as long as each parse extends the one before.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from paged.server.tool_parsers.json_scan import WS, CallDraft, Invalid, partial_suffix, skip_ws


@dataclass
class Parsed:
    content: str = ""  # content text safe to show (final: all of it)
    calls: list[CallDraft] = field(default_factory=list)


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class ToolParser:
    """A model family's tool-call format. Subclasses implement parse()."""

    name = ""

    def __init__(self, tools: Sequence[Any] | None = None) -> None:
        self.tools = tools  # the request's tools, for formats that need their schemas

    def parse(self, text: str, final: bool) -> Parsed:
        raise NotImplementedError

    def extract(self, text: str) -> tuple[str | None, list[CallDraft]]:
        """Non-streamed: (content or None, finished calls)."""
        p = self.parse(text, final=True)
        return p.content or None, p.calls


class TaggedBlockParser(ToolParser):
    """Calls in `START` ... `END` blocks, any number, text around them content (hermes,
    qwen3_coder). Subclasses set the tags and scan one block's call (`scan_block`)."""

    START = END = ""

    def scan_block(self, body: str, final: bool) -> tuple[CallDraft, int | None]:
        """The call at the start of `body` (after the start tag) and the index after it (None
        while it is open); raises Invalid for a malformed one."""
        raise NotImplementedError

    def parse(self, text: str, final: bool) -> Parsed:
        try:
            return self._parse(text, final)
        except Invalid:
            if final:
                return Parsed(text)  # not a well-formed call: all of it is content
        j = text.rfind(self.START)  # streaming: what was known before the first bad block
        while j > 0:
            try:
                return self._parse(text[:j], False)
            except Invalid:  # an earlier block is malformed too
                j = text.rfind(self.START, 0, j)
        return Parsed()

    def _parse(self, text: str, final: bool) -> Parsed:
        out = Parsed()
        rest: str | None = text
        while rest is not None:
            content, body = split_tagged(rest, self.START, final)
            if out.calls:  # whitespace right after a call separates; it is not content
                content = content.lstrip(WS)
                if content and out.content:  # text on both sides of calls: two paragraphs
                    content = "\n\n" + content
            out.content += content
            if body is None:
                break
            draft, end = self.scan_block(body, final)
            out.calls.append(draft)
            if end is None:
                break
            j = skip_ws(body, end)
            if body.startswith(self.END, j):
                rest = body[j + len(self.END) :]
            elif j == len(body) or (not final and self.END.startswith(body[j:])):
                break  # an unclosed last block, or its end tag still arriving
            else:
                raise Invalid  # text after the call inside the block
        return out


def split_tagged(text: str, start: str, final: bool) -> tuple[str, str | None]:
    """(content before the first `start` tag, the text after the tag or None when there is
    none). Whitespace right before a tag is a separator, not content; while not final,
    trailing whitespace and a partial tag are held back; a final partial tag (cut short by
    max_tokens or a stop string) is dropped."""
    j = text.find(start)
    if j >= 0:
        return text[:j].rstrip(WS), text[j + len(start) :]
    n = partial_suffix(text, start)
    if final and not n:
        return text, None
    return text[: len(text) - n].rstrip(WS), None


class ToolStreamer:
    """Feeds text deltas to a parser; returns (content delta, tool_calls deltas)."""

    def __init__(self, parser: ToolParser, max_calls: int | None = None) -> None:
        self.parser = parser
        self.max_calls = max_calls
        self.text = ""
        self.content_sent = ""
        self.sent: list[tuple[str, int]] = []  # (id, characters of arguments sent) per call

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        self.text += delta
        p = self.parser.parse(self.text, final)
        out = ""
        # A final parse may find the calls malformed (cut short) and call it all content:
        # calls already sent cannot be taken back, so that text is not sent again.
        if p.content.startswith(self.content_sent) and (p.calls or not self.sent):
            out = p.content[len(self.content_sent) :]
            self.content_sent = p.content
        calls = p.calls[: self.max_calls] if self.max_calls is not None else p.calls
        deltas: list[dict[str, Any]] = []
        for i, c in enumerate(calls):
            if c.name is None:
                break  # calls go out in order, each name before its arguments
            if i == len(self.sent):
                self.sent.append((tool_call_id(), 0))
                fn = {"name": c.name, "arguments": c.arguments}
                deltas.append({"index": i, "id": self.sent[i][0], "type": "function",
                               "function": fn})  # fmt: skip
                self.sent[i] = (self.sent[i][0], len(c.arguments))
            elif len(c.arguments) > self.sent[i][1]:
                new = c.arguments[self.sent[i][1] :]
                deltas.append({"index": i, "function": {"arguments": new}})
                self.sent[i] = (self.sent[i][0], len(c.arguments))
        return out, deltas

    @property
    def called(self) -> bool:
        return bool(self.sent)
