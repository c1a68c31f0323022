"""The reasoning-parser contract and its streamer.

A parser splits the text generated so far into reasoning and content; like the tool parsers
it is a pure function of that text (and of the prompt, which says whether the model starts
inside a think block), so streamed deltas join up to exactly the non-streamed message.
"""

from __future__ import annotations

from dataclasses import dataclass

from paged.server.tool_parsers.json_scan import WS, partial_suffix


@dataclass
class Split:
    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    """`<think>` ... `</think>`: what a subclass decides is where the reasoning starts."""

    name = ""
    start = "<think>"
    end = "</think>"

    def __init__(self, prompt: str | None = None) -> None:
        self.prompt = prompt or ""

    def starts_inside(self) -> bool:
        """True when the output begins inside the reasoning (no start tag needed)."""
        raise NotImplementedError

    def reasoning_expected(self) -> bool:
        """False when this output cannot hold reasoning (so structured outputs may apply from
        its first token): the prompt closed the think block itself."""
        return True

    def parse(self, text: str, final: bool) -> Split:
        if not self.reasoning_expected():
            return Split(content=text)
        inside = self.starts_inside()
        lead = text.lstrip(WS)
        if lead.startswith(self.start):
            text, inside = lead[len(self.start) :], True
        elif not final and self.start.startswith(lead):
            return Split()  # nothing yet, or the start of the tag: not known yet
        if not inside:
            return Split(content=text)
        reasoning, tag, content = text.partition(self.end)
        if tag:
            return Split(reasoning, content)
        if not final:  # hold back a partial end tag
            reasoning = reasoning[: len(reasoning) - partial_suffix(reasoning, self.end)]
        return Split(reasoning)

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """Non-streamed: (reasoning_content, content), each None when empty."""
        s = self.parse(text, final=True)
        return s.reasoning or None, s.content or None


class ReasoningStreamer:
    """Feeds text deltas to a parser; returns (reasoning delta, content delta)."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent = Split()

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        self.text += delta
        s = self.parser.parse(self.text, final)
        out = []
        for part in ("reasoning", "content"):
            new, old = getattr(s, part), getattr(self.sent, part)
            if new.startswith(old):
                out.append(new[len(old) :])
                setattr(self.sent, part, new)
            else:
                out.append("")
        return out[0], out[1]
