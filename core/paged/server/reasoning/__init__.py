"""Reasoning parsers, by the names `--reasoning-parser` takes (vLLM's)."""

from __future__ import annotations

from paged.server.reasoning.base import ReasoningParser, ReasoningStreamer, Split
from paged.server.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from paged.server.reasoning.qwen3 import Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}

__all__ = ["REASONING_PARSERS", "ReasoningParser", "ReasoningStreamer", "Split"]
