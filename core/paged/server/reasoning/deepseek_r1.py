"""deepseek_r1: the output is reasoning up to `</think>` (a leading `<think>` is optional: the
DeepSeek-R1 templates put it in the prompt), then content. No `</think>`: all reasoning."""

from __future__ import annotations

from paged.server.reasoning.base import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"

    def starts_inside(self) -> bool:
        return True
