"""Tool calls and reasoning in chat outputs: what a request's tool_choice asks of the output,
and how the generated text becomes a message (or stream deltas) with reasoning_content,
content and tool_calls."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from paged.sampling.params import check_structured_stop
from paged.sampling.schema_limits import rebase_refs
from paged.server.errors import APIError, bad_request
from paged.server.protocol import ChatCompletionRequest, NamedToolChoice
from paged.server.reasoning import REASONING_PARSERS, ReasoningParser, ReasoningStreamer
from paged.server.tool_parsers import (
    TOOL_PARSERS,
    CallDraft,
    NamedToolParser,
    RequiredToolParser,
    ToolParser,
    ToolStreamer,
)
from paged.server.tool_parsers.base import tool_call_id

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass
class ParsingOptions:
    """The server's flags: --enable-auto-tool-choice, --tool-call-parser, --reasoning-parser."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            names = ", ".join(TOOL_PARSERS)
            raise ValueError(f"--tool-call-parser: {self.tool_call_parser!r} is not one of {names}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice: needs --tool-call-parser")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            names = ", ".join(REASONING_PARSERS)
            raise ValueError(f"--reasoning-parser: {self.reasoning_parser!r} is not one of {names}")


def effective_tool_choice(req: ChatCompletionRequest) -> str | NamedToolChoice:
    """vLLM's default: "auto" when tools are given, else "none"."""
    if req.tool_choice is not None:
        return req.tool_choice
    return "auto" if req.tools else "none"


def required_schema(req: ChatCompletionRequest) -> dict[str, Any]:
    """vLLM's schema for tool_choice "required": an array of {name, parameters}, one of the
    tools each. A tool's root-relative `$ref`s ("#/$defs/X", "#/definitions/X", "#") are
    pointed at its parameters' place in this schema, so tools defining the same name
    differently keep their own (vLLM gathers `$defs` at the top and refuses such clashes)."""
    variants = []
    for i, t in enumerate(req.tools or []):
        params = t.function.parameters or EMPTY_PARAMETERS
        variants.append(
            {
                "properties": {
                    "name": {"type": "string", "enum": [t.function.name]},
                    "parameters": rebase_refs(params, f"#/items/anyOf/{i}/properties/parameters"),
                },
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": variants},
    }
    if req.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return schema


def named_schema(req: ChatCompletionRequest, name: str) -> dict[str, Any]:
    """A named function: the output is its arguments, an object of its parameters' schema."""
    tool = next(t for t in req.tools or [] if t.function.name == name)
    return tool.function.parameters or EMPTY_PARAMETERS


class ChatParsing:
    """One request's output parsing: reasoning first, then tool calls in the content."""

    def __init__(
        self, opts: ParsingOptions, req: ChatCompletionRequest, prompt_text: str | None
    ) -> None:
        choice = effective_tool_choice(req)
        if choice == "auto" and not opts.enable_auto_tool_choice:
            msg = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser'
            raise APIError(400, f"tool_choice: {msg} to be set", "tool_choice")
        self.choice = choice
        self.tool_parser: ToolParser | None = None
        self.schema: dict[str, Any] | None = None  # what structured outputs must enforce
        self.schema_field = "tools"  # where the schema came from (errors name it)
        if isinstance(choice, NamedToolChoice):
            self.tool_parser = NamedToolParser(choice.function.name)
            self.schema = named_schema(req, choice.function.name)
            names = [t.function.name for t in req.tools or []]
            self.schema_field = f"tools[{names.index(choice.function.name)}].function.parameters"
        elif choice == "required":
            self.tool_parser = RequiredToolParser()
            self.schema = required_schema(req)
        elif choice == "auto":
            assert opts.tool_call_parser is not None
            self.tool_parser = TOOL_PARSERS[opts.tool_call_parser](req.tools)  # their schemas
        if self.schema is not None:  # enforced by a grammar: refused as SamplingParams does
            named = isinstance(choice, NamedToolChoice)
            what = "a named tool choice" if named else 'tool_choice "required"'
            try:
                check_structured_stop(req.min_tokens, req.ignore_eos, what)
            except ValueError as e:
                raise bad_request(e) from None
        self.max_calls = 1 if req.parallel_tool_calls is False else None
        self.eos_text: str | None = None  # cut off the end (see keep_special_tokens)
        self.reasoning: ReasoningParser | None = None
        if opts.reasoning_parser is not None:
            self.reasoning = REASONING_PARSERS[opts.reasoning_parser](prompt_text)

    def keep_special_tokens(self, tok: Any) -> bool:
        """True when the tool parser's tags are special tokens of `tok` (Mistral's
        [TOOL_CALLS]): the text must keep special tokens for the parser to see them (as in
        vLLM); the end-of-sequence token's text is then cut off the output again."""
        tags = getattr(self.tool_parser, "special_tags", ())
        if not tags or tok is None:
            return False
        special = {t.content for t in tok.added_tokens_decoder.values() if t.special}
        if not special.intersection(tags):
            return False
        self.eos_text = tok.eos_token or None
        return True

    def cut_eos(self, text: str) -> str:
        """The text without a final end-of-sequence token (kept with special tokens)."""
        return text.removesuffix(self.eos_text) if self.eos_text else text

    @property
    def active(self) -> bool:
        return self.tool_parser is not None or self.reasoning is not None

    @property
    def reasoning_end(self) -> str | None:
        """The text after which structured outputs apply, or None: from the first token."""
        if self.reasoning is None or not self.reasoning.reasoning_expected():
            return None
        return self.reasoning.end

    def finish_reason(self, called: bool, reason: str | None) -> str | None:
        """vLLM's: "tool_calls" when auto produced calls, or required did and stopped; a
        named function keeps "stop" (as OpenAI)."""
        if not called or isinstance(self.choice, NamedToolChoice):
            return reason
        if self.choice == "required" and reason != "stop":
            return reason
        return "tool_calls"

    def message(self, text: str) -> tuple[dict[str, Any], bool]:
        """The non-streamed message, and whether it holds tool calls."""
        msg: dict[str, Any] = {"role": "assistant"}
        text = self.cut_eos(text)
        content: str | None = text
        if self.reasoning is not None:
            msg["reasoning_content"], content = self.reasoning.extract(text)
        calls: list[CallDraft] = []
        if self.tool_parser is not None:
            content, calls = self.tool_parser.extract(content or "")
            calls = calls[: self.max_calls] if self.max_calls else calls
        msg["content"] = content
        if calls:
            msg["tool_calls"] = [
                {"id": tool_call_id(), "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments}}
                for c in calls
            ]  # fmt: skip
        return msg, bool(calls)

    def streamer(self) -> ChatStreamer:
        return ChatStreamer(self)


class ChatStreamer:
    """One choice's stream: text deltas in, OpenAI delta bodies out."""

    def __init__(self, parsing: ChatParsing) -> None:
        self.parsing = parsing
        self.reasoning = ReasoningStreamer(parsing.reasoning) if parsing.reasoning else None
        self.tools = (
            ToolStreamer(parsing.tool_parser, parsing.max_calls) if parsing.tool_parser else None
        )

    @property
    def called(self) -> bool:
        return self.tools is not None and self.tools.called

    def feed(self, delta: str, final: bool) -> dict[str, Any]:
        out: dict[str, Any] = {}
        content = delta = self.parsing.cut_eos(delta) if final else delta
        if self.reasoning is not None:
            reasoning, content = self.reasoning.feed(delta, final)
            if reasoning:
                out["reasoning_content"] = reasoning
        if self.tools is not None:
            content, calls = self.tools.feed(content, final)
            if calls:
                out["tool_calls"] = calls
        if content:
            out["content"] = content
        return out
