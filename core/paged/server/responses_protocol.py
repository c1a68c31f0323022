"""OpenAI Responses API request bodies (POST /v1/responses) and their translation into chat
messages. Unknown fields and item types are 400s naming them."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from paged.server.protocol import MAX_TOOLS, OpenAIModel, RequestBody, type_tag


class InputText(OpenAIModel):
    type: Literal["input_text"]
    text: str


class OutputText(OpenAIModel):
    """An earlier response's text, sent back as input."""

    type: Literal["output_text"]
    text: str
    annotations: Annotated[list[Any], Field(max_length=0)] | None = None
    logprobs: list[Any] | None = None  # as this server returned them: not read


Part = Annotated[InputText | OutputText, Field(discriminator="type")]


class MessageItem(OpenAIModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | Annotated[list[Part], Field(min_length=1)]
    id: str | None = None  # an output item sent back
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Literal["commentary", "final_answer"] | None = None  # an output item's: not read

    def text(self) -> str:
        c = self.content
        return c if isinstance(c, str) else "\n".join(p.text for p in c)


class FunctionCallItem(OpenAIModel):
    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1, max_length=256)]
    name: Annotated[str, Field(min_length=1, max_length=256)]
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    @field_validator("arguments")
    @classmethod
    def _json(cls, v: str) -> str:
        """Checked here (templates read arguments parsed), so the error names this item."""
        try:
            json.loads(v)
        except ValueError:
            raise ValueError("not valid JSON") from None
        return v


class FunctionCallOutputItem(OpenAIModel):
    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1, max_length=256)]
    output: str | Annotated[list[InputText], Field(min_length=1)]  # parts: their texts joined
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        o = self.output
        return o if isinstance(o, str) else "".join(p.text for p in o)


Item = Annotated[
    Annotated[MessageItem, Tag("message item")]
    | Annotated[FunctionCallItem, Tag("function_call item")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output item")],
    Discriminator(
        lambda v: type_tag(v, "item", "message"),
        custom_error_type="invalid_item",
        custom_error_message="type: must be message, function_call or function_call_output "
        "(other items are not supported)",
    ),
]


class FunctionTool(OpenAIModel):
    type: Literal["function"]
    name: Annotated[str, Field(min_length=1, max_length=256)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # schemas are enforced for required / named choices


class FunctionChoice(OpenAIModel):
    type: Literal["function"]
    name: str


class TextFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(max_length=256)] | None = None  # json_schema
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> TextFormat:
        # names relative to text.format: the error's location prefixes them
        if (self.type == "json_schema") != (self.schema_ is not None):
            raise ValueError("schema: required with type json_schema, and only then")
        if self.type == "json_schema" and not self.name:
            raise ValueError("name: required with type json_schema")
        return self


class TextConfig(OpenAIModel):
    format: TextFormat | None = None


class ResponsesRequest(RequestBody):
    model: str | None = None
    input: Annotated[str, Field(max_length=10_000_000)] | Annotated[list[Item], Field(min_length=1)]
    instructions: str | None = None  # a system message first (not carried to the next response)
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    previous_response_id: Annotated[str, Field(max_length=256)] | None = None
    store: bool = True
    metadata: (
        Annotated[
            dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
            Field(max_length=16),
        ]
        | None
    ) = None  # OpenAI's limits
    user: str | None = None  # as chat's; echoed in the response
    text: TextConfig | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    truncation: Literal["disabled"] | None = None  # "auto" (dropping old turns) is refused
    include: Annotated[list[str], Field(max_length=0)] | None = None

    @model_validator(mode="after")
    def _tools(self) -> ResponsesRequest:
        names = [t.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        c = self.tool_choice
        if isinstance(c, FunctionChoice) and c.name not in names:
            raise ValueError(f"tool_choice: the function {c.name[:100]!r} is not in tools")
        elif c not in (None, "none") and not names:  # as chat refuses it
            raise ValueError(f"tool_choice: {c!r} needs tools")
        # an output answers an earlier call (as OpenAI's; with previous_response_id the calls
        # may be stored ones: checked on the joined conversation)
        calls: set[str] = set()
        alone = isinstance(self.input, list) and self.previous_response_id is None
        for i, item in enumerate(self.input if alone else ()):
            if isinstance(item, FunctionCallItem):
                calls.add(item.call_id)
            elif isinstance(item, FunctionCallOutputItem) and item.call_id not in calls:
                raise ValueError(f"input[{i}].call_id: no earlier function_call has the call_id "
                                 f"{item.call_id[:100]!r}")  # fmt: skip
        return self

    def input_messages(self) -> list[dict[str, Any]]:
        """The input items as chat messages (consecutive calls join one assistant turn)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        out: list[dict[str, Any]] = []
        for item in self.input:
            if isinstance(item, MessageItem):  # developer too: rendered as on chat completions
                out.append({"role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                call = {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments},
                }
                last = out[-1] if out else None
                if last is None or last["role"] != "assistant":
                    out.append(last := {"role": "assistant", "content": ""})
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        return out

    def chat_fields(self) -> dict[str, Any]:
        """The chat request's fields besides the messages."""
        kw: dict[str, Any] = {
            "max_tokens": self.max_output_tokens,
            "user": self.user,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "parallel_tool_calls": self.parallel_tool_calls,
        }
        f = self.text.format if self.text else None
        if f is not None and f.type == "json_object":
            kw["response_format"] = {"type": "json_object"}
        elif f is not None and f.type == "json_schema":
            kw["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": f.name, "schema": f.schema_, "strict": f.strict},
            }
        if self.tools:
            kw["tools"] = [
                {"type": "function", "function": t.model_dump(exclude={"type"})} for t in self.tools
            ]
        c = self.tool_choice
        if isinstance(c, FunctionChoice):
            kw["tool_choice"] = {"type": "function", "function": {"name": c.name}}
        elif c is not None:
            kw["tool_choice"] = c
        return kw
