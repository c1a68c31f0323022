"""qwen3: `<think>` ... `</think>` then content. The output is inside the think block from its
start when the prompt ends with an open `<think>` (Qwen3 thinking templates); otherwise only
when it starts with `<think>`. With thinking disabled (the template closes an empty think
block in the prompt: enable_thinking false) everything is content."""

from __future__ import annotations

from paged.server.reasoning.base import ReasoningParser
from paged.server.tool_parsers.json_scan import WS


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"

    def starts_inside(self) -> bool:
        return self.prompt.rstrip(WS).endswith(self.start)

    def reasoning_expected(self) -> bool:
        return not self.prompt.rstrip(WS).endswith(self.end)
