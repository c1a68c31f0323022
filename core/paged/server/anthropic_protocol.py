"""Anthropic Messages API request bodies (POST /v1/messages, /v1/messages/count_tokens), and
their translation into a ChatCompletionRequest. Unknown fields and block types are 400s."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, model_validator

from paged.server.protocol import (
    MAX_STOP,
    MAX_TOOLS,
    MAX_TOP_K,
    ChatCompletionRequest,
    OpenAIModel,
    RequestBody,
    type_tag,
)


class CacheControl(OpenAIModel):
    """Prompt caching: the engine's prefix cache reuses every shared prefix by itself."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(OpenAIModel):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[Any] | None = None  # an earlier reply's, as the SDK dumps it: not read


class ToolUseBlock(OpenAIModel):
    type: Literal["tool_use"]
    id: Annotated[str, Field(min_length=1, max_length=256)]
    name: Annotated[str, Field(min_length=1, max_length=256)]
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    # an earlier reply's, as the SDK dumps them: not read
    caller: dict[str, Any] | None = None
    toolset_name: str | None = None


class ToolResultBlock(OpenAIModel):
    type: Literal["tool_result"]
    tool_use_id: Annotated[str, Field(min_length=1, max_length=256)]
    content: str | list[TextBlock] | None = None
    is_error: bool = False  # the result is sent as "Error: <content>"
    cache_control: CacheControl | None = None

    def text(self) -> str:
        c = self.content
        body = c if isinstance(c, str) else "".join(b.text for b in c or [])
        return f"Error: {body}" if self.is_error else body


class ThinkingBlock(OpenAIModel):
    """An earlier turn's thinking, sent back: it reaches the template as reasoning_content."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


Block = Annotated[
    Annotated[TextBlock, Tag("text block")]
    | Annotated[ToolUseBlock, Tag("tool_use block")]
    | Annotated[ToolResultBlock, Tag("tool_result block")]
    | Annotated[ThinkingBlock, Tag("thinking block")],
    Discriminator(
        lambda v: type_tag(v, "block"),
        custom_error_type="invalid_block",
        custom_error_message="type: must be text, tool_use, tool_result or thinking (other "
        "blocks are not supported)",
    ),
]


class Message(OpenAIModel):
    role: Literal["user", "assistant"]
    content: str | Annotated[list[Block], Field(min_length=1)]


class Tool(OpenAIModel):
    """A client tool (server tools such as web search, with their own `type`, are refused)."""

    type: Literal["custom"] | None = None
    name: Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[a-zA-Z0-9_-]+$")]
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolChoice(OpenAIModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # type "tool"
    disable_parallel_tool_use: bool = False  # at most one tool_use block

    @model_validator(mode="after")
    def _name_iff_tool(self) -> ToolChoice:
        # fields named within tool_choice: the error's location prefixes them
        if (self.type == "tool") != (self.name is not None):
            raise ValueError('name: required with type "tool", and only with it')
        if self.type == "none" and self.disable_parallel_tool_use:
            raise ValueError('disable_parallel_tool_use: not with type "none"')
        return self


class Thinking(OpenAIModel):
    """enabled (with a budget) or adaptive: the template is asked to think (Qwen3's
    enable_thinking) and the reasoning parser's output becomes thinking blocks."""

    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: int | None = Field(None, ge=1024)
    display: Literal["summarized"] | None = None  # "omitted" (redacted thinking) is refused

    @model_validator(mode="after")
    def _budget_iff_enabled(self) -> Thinking:
        if (self.type == "enabled") != (self.budget_tokens is not None):
            raise ValueError('budget_tokens: required with type "enabled", and only then')
        return self


class JsonFormat(OpenAIModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(OpenAIModel):
    """Structured outputs: the text follows the schema (effort levels are refused)."""

    format: JsonFormat | None = None


class Metadata(OpenAIModel):
    user_id: Annotated[str, Field(max_length=256)] | None = None  # as chat's `user`


class CountTokensRequest(RequestBody):
    model: str | None = None
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | Annotated[list[TextBlock], Field(min_length=1)] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None

    @model_validator(mode="after")
    def _tools(self) -> CountTokensRequest:
        names = [t.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: tool names must be unique")
        choice = self.tool_choice
        if choice is not None and choice.type == "tool" and choice.name not in names:
            raise ValueError(
                f"tool_choice.name: the tool {str(choice.name)[:100]!r} is not in tools"
            )
        if choice is not None and choice.type in ("any", "tool") and not names:
            raise ValueError(f"tool_choice: {choice.type!r} needs tools")
        calls: set[str] = set()  # tool_use ids so far: a tool_result answers one of them
        for i, m in enumerate(self.messages):
            for j, b in enumerate(m.content if isinstance(m.content, list) else []):
                if isinstance(b, ToolUseBlock):
                    calls.add(b.id)
                elif isinstance(b, ToolResultBlock) and b.tool_use_id not in calls:
                    raise ValueError(f"messages[{i}].content[{j}].tool_use_id: "
                                     f"{b.tool_use_id[:100]!r} answers no earlier tool_use "
                                     "block")  # fmt: skip
        return self

    def chat_request(
        self, reasoning_parser: str | None, max_tokens: int | None = None, **sampling: Any
    ) -> ChatCompletionRequest:
        """The same conversation as a chat request (ValueError names this API's field)."""
        thinking = self.thinking is not None and self.thinking.type != "disabled"
        if thinking:
            if reasoning_parser is None:
                raise ValueError("thinking: this server has no --reasoning-parser")
            budget = self.thinking.budget_tokens
            if max_tokens is not None and budget is not None and budget >= max_tokens:
                raise ValueError("thinking.budget_tokens: must be less than max_tokens")
        kwargs: dict[str, Any] = {}
        if reasoning_parser is not None:  # Qwen3-style templates: think only when asked
            kwargs["chat_template_kwargs"] = {"enable_thinking": thinking}
        tools = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description,
                    "parameters": t.input_schema,
                },
            }
            for t in self.tools or []
        ]
        choice: Any = None
        parallel = True
        if self.tool_choice is not None:
            c = self.tool_choice
            named = {"type": "function", "function": {"name": c.name}}
            choice = {"auto": "auto", "any": "required", "none": "none", "tool": named}[c.type]
            parallel = not c.disable_parallel_tool_use
        elif tools:
            choice = "auto"
        # A last assistant message is a prefill: the reply continues its text (Anthropic's)
        prefill = self.messages[-1].role == "assistant"
        return ChatCompletionRequest(
            messages=self.chat_messages(),
            add_generation_prompt=not prefill,
            continue_final_message=prefill,
            tools=tools or None,
            tool_choice=choice,
            parallel_tool_calls=parallel,
            max_tokens=max_tokens,
            thinking_token_budget=self.thinking.budget_tokens if thinking else None,
            **kwargs,
            **sampling,
        )

    def chat_messages(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self.system is not None:
            s = self.system
            out.append(
                {
                    "role": "system",
                    "content": s if isinstance(s, str) else "".join(b.text for b in s),
                }
            )
        for i, m in enumerate(self.messages):
            if isinstance(m.content, str):
                out.append({"role": m.role, "content": m.content})
            elif m.role == "user":
                out += _user_turn(m.content, i)
            else:
                out.append(_assistant_turn(m.content, i))
        return out


def _user_turn(blocks: list[Any], i: int) -> list[dict[str, Any]]:
    """Tool results become tool messages; text between them, user messages."""
    out: list[dict[str, Any]] = []
    for j, b in enumerate(blocks):
        if isinstance(b, ToolResultBlock):
            out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()})
        elif isinstance(b, TextBlock):
            if out and out[-1]["role"] == "user":
                out[-1]["content"] += b.text
            else:
                out.append({"role": "user", "content": b.text})
        else:
            raise ValueError(
                f"messages[{i}].content[{j}]: a {b.type} block only in assistant turns"
            )
    return out


def _assistant_turn(blocks: list[Any], i: int) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": ""}
    calls = []
    for j, b in enumerate(blocks):
        if isinstance(b, TextBlock):
            msg["content"] += b.text
        elif isinstance(b, ToolUseBlock):
            fn = {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}
            calls.append({"id": b.id, "type": "function", "function": fn})
        elif isinstance(b, ThinkingBlock):
            msg["reasoning_content"] = msg.get("reasoning_content", "") + b.thinking
        else:
            raise ValueError(f"messages[{i}].content[{j}]: a tool_result block only in user turns")
    if calls:
        msg["tool_calls"] = calls
    return msg


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=1, le=MAX_TOP_K)
    stop_sequences: (
        Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_STOP)] | None
    ) = None
    stream: bool = False
    metadata: Metadata | None = None
    cache_control: CacheControl | None = None
    output_config: OutputConfig | None = None

    def to_chat(self, reasoning_parser: str | None) -> ChatCompletionRequest:
        sampling = {k: getattr(self, k) for k in ("temperature", "top_p", "top_k")}
        user = self.metadata.user_id if self.metadata else None
        fmt = self.output_config.format if self.output_config else None
        if fmt is not None:
            sampling["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": fmt.schema_},
            }
        return self.chat_request(
            reasoning_parser, self.max_tokens, stop=self.stop_sequences, user=user, **sampling
        )
