"""Tool-call parsers, by the names `--tool-call-parser` takes (vLLM's)."""

from __future__ import annotations

from paged.server.tool_parsers.base import Parsed, ToolParser, ToolStreamer
from paged.server.tool_parsers.hermes import HermesToolParser
from paged.server.tool_parsers.json_scan import CallDraft
from paged.server.tool_parsers.llama3_json import Llama3JsonToolParser
from paged.server.tool_parsers.mistral import MistralToolParser
from paged.server.tool_parsers.phi4_mini_json import Phi4MiniJsonToolParser
from paged.server.tool_parsers.pythonic import PythonicToolParser
from paged.server.tool_parsers.qwen3_coder import Qwen3CoderToolParser
from paged.server.tool_parsers.required import NamedToolParser, RequiredToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "phi4_mini_json": Phi4MiniJsonToolParser,
    "pythonic": PythonicToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
}

__all__ = [
    "TOOL_PARSERS",
    "CallDraft",
    "NamedToolParser",
    "Parsed",
    "RequiredToolParser",
    "ToolParser",
    "ToolStreamer",
]
