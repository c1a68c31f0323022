"""OpenAI request bodies as pydantic models (responses are built as plain dicts).

Types and sizes are checked here; value ranges by SamplingParams.validate(), so that the
offline API and the server refuse the same things with the same messages.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    field_validator,
    model_validator,
)

from paged.sampling.params import SamplingParams, StructuredOutputsParams
from paged.sampling.schema_limits import malformed

MAX_N = 128  # sequences per prompt
MAX_LIST = 1024  # stop_token_ids, logit_bias entries
MAX_STOP = 64  # stop strings
MAX_ALLOWED_IDS = 1 << 20  # allowed_token_ids entries
MAX_TOP_K = 2**31 - 1  # larger values would overflow the sampler's int64 tensors
TokenId = Annotated[StrictInt, Field(ge=0)]
Seed = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]  # n > 1: sample i uses seed + i


def _keep_count(k: int) -> int:
    if k == 0:
        raise ValueError("must be -1 or a positive integer")
    return k


# vLLM's truncate_prompt_tokens: keep the prompt's last k tokens; -1: the model's maximum
# context length. Completions, chat and embeddings; resolved by serving.truncation.
TruncatePromptTokens = Annotated[int, Field(ge=-1), AfterValidator(_keep_count)]


def type_tag(v: Any, kind: str, default: str | None = None) -> str | None:
    """A tagged union's tag for v: its `type` (else `default`) and " <kind>". Pydantic puts
    the tag in error locations; not an identifier, errors.py leaves it out (input[1].arguments,
    not input[1].function_call.arguments)."""
    t = (v.get("type") if isinstance(v, dict) else getattr(v, "type", None)) or default
    return f"{t} {kind}" if isinstance(t, str) else None


class OpenAIModel(BaseModel):
    # Every field is honoured or refused: an unknown one is a 400 naming it, never ignored.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


def check_unicode(value: Any, path: str = "") -> None:
    """Raise ValueError naming the field of a string holding a lone surrogate: JSON escapes
    (\\ud800) can carry one, and neither tokenizers nor response encoders accept it."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{path or 'body'}: invalid Unicode (a lone surrogate)") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            check_unicode(k, path or "body")
            check_unicode(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            if not isinstance(v, int | float | bool):
                check_unicode(v, f"{path}[{i}]")


class RequestBody(OpenAIModel):
    """A top-level request body: every string in it must be valid Unicode."""

    @model_validator(mode="before")
    @classmethod
    def _unicode(cls, data: Any) -> Any:
        check_unicode(data)
        return data


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # usage (so far) in every chunk


class JsonSchemaFormat(OpenAIModel):
    """response_format.json_schema: OpenAI's {name, description, schema, strict}."""

    name: str = Field(max_length=256)
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # the output always follows the schema (xgrammar is strict)


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("json_schema is required when type is json_schema")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError("json_schema is only allowed with type json_schema")
        return self


class StructuredOutputsRequest(OpenAIModel):
    """vLLM's `structured_outputs` object: one of json, regex, choice, grammar, json_object."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1, max_length=MAX_LIST)] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


class SamplingRequest(RequestBody):
    """The fields completions and chat share."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, le=MAX_TOP_K)
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: Seed | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_LIST)] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_LIST)] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    spaces_between_special_tokens: bool = True  # slow tokenizers (fast ones never add them)
    use_beam_search: bool = False  # n is the beam width (server/beam.py)
    length_penalty: float = 1.0  # beam ranking: cumulative logprob / length ** length_penalty
    user: str | None = None  # the end user: named in the request log line and trace span
    # Structured outputs (docs/structured.md): at most one of these five.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1, max_length=MAX_LIST)] | None = None
    guided_grammar: str | None = None
    allowed_token_ids: (
        Annotated[list[TokenId], Field(min_length=1, max_length=MAX_ALLOWED_IDS)] | None
    ) = None
    bad_words: Annotated[list[str], Field(max_length=MAX_LIST)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return self

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None = None
    ) -> SamplingParams:
        """SamplingParams of this request; ValueError names the field."""
        bias = None
        if self.logit_bias:
            bias = {}
            for k, v in self.logit_bias.items():
                try:
                    bias[int(k)] = v
                except ValueError:
                    raise ValueError(
                        f"logit_bias: keys must be token ids, got {k[:20]!r}"
                    ) from None
                if not -100 <= v <= 100:
                    raise ValueError("logit_bias: values must be in [-100, 100]")
        set_ = {
            k: getattr(self, k)
            for k in (
                "temperature",
                "top_p",
                "top_k",
                "min_p",
                "repetition_penalty",
                "presence_penalty",
                "frequency_penalty",
            )
            if getattr(self, k) is not None
        }
        return SamplingParams(
            structured_outputs=self.structured_outputs_params(),
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            n=self.n,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logit_bias=bias,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            logprobs=logprobs,
            **set_,
        )

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The one structured-output constraint this request asks for, checked (the spec
        parses); ValueError names the field as the client spelled it."""
        given = []  # (field, kwargs of StructuredOutputsParams)
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            given.append(("response_format", {"json_object": True}))
        elif rf is not None and rf.type == "json_schema":
            schema = rf.json_schema.json_schema
            if schema is None:
                raise ValueError("response_format.json_schema.schema: required")
            given.append(("response_format.json_schema.schema", {"json": schema}))
        so = self.structured_outputs
        if so is not None:
            kw = {k: v for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                    ("grammar", so.grammar), ("json_object", so.json_object))
                  if v not in (None, False)}  # fmt: skip
            if len(kw) != 1:
                raise ValueError(
                    "structured_outputs: give exactly one of json, regex, choice, grammar, "
                    f"json_object (got {', '.join(kw) or 'none'})"
                )
            kind = next(iter(kw))
            kw["disable_any_whitespace"] = so.disable_any_whitespace
            given.append((f"structured_outputs.{kind}", kw))
        for name in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{name}")
            if value is not None:
                given.append((f"guided_{name}", {name: value}))
        if not given:
            return None
        if len(given) > 1:
            names = [f.split(".")[0] for f, _ in given]
            raise ValueError(
                f"{names[1]}: only one structured output constraint per request "
                f"(got {', '.join(names)})"
            )
        field, kw = given[0]
        try:
            sp = StructuredOutputsParams(**kw)
        except ValueError as e:  # "structured_outputs.json: ..." -> the client's spelling
            raise ValueError(f"{field}: {str(e).split(': ', 1)[-1]}") from None
        from paged.sampling.structured import check_spec

        check_spec(sp, field)
        return sp


Prompt = (
    Annotated[str, Field(max_length=10_000_000)]
    | Annotated[list[str], Field(min_length=1)]
    | Annotated[list[TokenId], Field(min_length=1)]
    | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
)


class CompletionRequest(SamplingRequest):
    prompt: Prompt
    max_tokens: int | None = 16
    echo: bool = False  # the prompt before the completion (with its logprobs when asked)
    logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None  # not a boolean (chat's)
    best_of: int | None = Field(None, ge=1, le=MAX_N)  # keep the n most likely of best_of
    suffix: str | None = None  # refused: no fill-in-the-middle template
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    truncate_prompt_tokens: TruncatePromptTokens | None = None  # keep the last k (-1: all fit)
    add_special_tokens: bool = True  # vLLM's: string prompts get the tokenizer's BOS etc.

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None = None
    ) -> SamplingParams:
        p = super().sampling_params(max_tokens, logprobs)
        best_of = self.best_of if self.best_of is not None and self.best_of > self.n else None
        prompt_lps = self.prompt_logprobs
        if self.echo and self.logprobs is not None:  # the echoed prompt's logprobs
            prompt_lps = max(prompt_lps or 0, self.logprobs)
        if best_of is None and prompt_lps is None:
            return p
        return dataclasses.replace(p, best_of=best_of, prompt_logprobs=prompt_lps)


class TextPart(OpenAIModel):
    type: str
    text: str | None = None


MAX_TOOLS = 512  # tools per request


TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for function names


class FunctionDefinition(OpenAIModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None  # the schema is always enforced for required / named choices

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if not TOOL_NAME.fullmatch(name):
            raise ValueError("must be 1 to 64 letters, digits, underscores or dashes")
        return name

    @field_validator("parameters")
    @classmethod
    def _schema_shape(cls, schema: dict[str, Any] | None) -> dict[str, Any] | None:
        if schema is not None and (found := malformed(schema)) is not None:
            where, why = found
            raise ValueError(f"invalid JSON schema: at {where or 'the root'}: {why}")
        return schema


class ChatCompletionTool(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


Tools = Annotated[list[ChatCompletionTool], Field(min_length=1, max_length=MAX_TOOLS)]


class FunctionName(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionName


class FunctionCall(OpenAIModel):
    name: str
    arguments: str  # JSON text, as the API returns it


class ToolCall(OpenAIModel):
    """A call in an assistant message of the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)  # template-specific keys
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool: the call this message answers

    @model_validator(mode="after")
    def _has_content(self) -> ChatMessage:
        """Only an assistant message may leave content out (its tool_calls, or a prefix); a
        tool message names the call it answers (as OpenAI requires)."""
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content: missing (a string or a list of parts): a {self.role} "
                             "message needs it")  # fmt: skip
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("tool_call_id: missing: a tool message needs the id of its call")
        if self.content == [] and self.role != "assistant":
            raise ValueError("content: empty: give a string or at least one part")
        return self

    def as_template_input(self, index: int) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            if any(p.type != "text" or p.text is None for p in content):
                raise ValueError(f"messages[{index}].content: only text parts are supported")
            content = "\n".join(p.text or "" for p in content)  # as vLLM joins text parts
        msg = self.model_dump(exclude_none=True)
        msg["content"] = content or ""
        if self.tool_calls is not None:
            if self.role != "assistant":
                raise ValueError(f"messages[{index}].tool_calls: only assistant messages have them")
            # Templates read arguments as a mapping (vLLM passes them parsed, too).
            for j, call in enumerate(msg["tool_calls"]):
                try:
                    call["function"]["arguments"] = json.loads(call["function"]["arguments"])
                except ValueError:
                    field = f"messages[{index}].tool_calls[{j}].function.arguments"
                    raise ValueError(f"{field}: not valid JSON") from None
        return msg

    def text_length(self) -> int:
        """Characters of text content (what tokenizing it costs)."""
        if isinstance(self.content, list):
            return sum(len(p.text or "") + 1 for p in self.content)
        return len(self.content or "")


# apply_chat_template's own arguments: chat_template_kwargs may not set them (a request never
# brings a template, tools go in `tools`); the rest reach the template as plain data.
RESERVED_TEMPLATE_ARGS = frozenset(
    ("chat_template", "conversation", "messages", "tools", "documents", "tokenize",
     "add_generation_prompt", "continue_final_message", "padding", "truncation", "max_length",
     "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs")
)  # fmt: skip


class ChatTemplateOptions(OpenAIModel):
    """vLLM's chat-template fields of a chat request."""

    # The final (assistant) message left open for the model to continue; needs
    # add_generation_prompt false.
    continue_final_message: bool = False
    # Variables for the server's chat template (e.g. enable_thinking): data, never a template.
    chat_template_kwargs: Annotated[dict[str, Any], Field(max_length=64)] | None = None

    def _adds_generation_prompt(self) -> bool:
        return bool(getattr(self, "add_generation_prompt", False))

    @model_validator(mode="after")
    def _template_options(self) -> ChatTemplateOptions:
        if self.continue_final_message and self._adds_generation_prompt():
            raise ValueError(
                "continue_final_message: cannot be used with add_generation_prompt; "
                "set add_generation_prompt to false"
            )
        for key in self.chat_template_kwargs or {}:
            if key in RESERVED_TEMPLATE_ARGS or not key.isidentifier():
                raise ValueError(
                    f"chat_template_kwargs: {key[:60]!r} cannot be set here (template variables "
                    "only; the server's chat template is the one applied)"
                )
        return self

    def template_kwargs(self) -> dict[str, Any]:
        """What apply_chat_template receives besides the conversation and tools."""
        kw = dict(self.chat_template_kwargs or {})
        if self.continue_final_message:
            kw["continue_final_message"] = True
        return kw


class ChatCompletionRequest(SamplingRequest, ChatTemplateOptions):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    tools: Tools | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = True  # false: at most one call
    prompt_logprobs: int | None = Field(None, ge=0, le=20)  # vLLM's; not with stream
    truncate_prompt_tokens: TruncatePromptTokens | None = None  # the rendered prompt's last k
    # vLLM's: the tokenizer's special tokens (BOS, ...) on top of the template's (default: not)
    add_special_tokens: bool = False
    # vLLM's: the last message's content (when it is the assistant's, the reply's role) before
    # the reply's content; streamed as the first content delta
    echo: bool = False
    # vLLM's: at most this many tokens of reasoning, then the reasoning parser's end marker is
    # forced (needs --reasoning-parser).
    thinking_token_budget: int | None = Field(None, ge=0)

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None = None
    ) -> SamplingParams:
        p = super().sampling_params(max_tokens, logprobs)
        if self.prompt_logprobs is None:
            return p
        return dataclasses.replace(p, prompt_logprobs=self.prompt_logprobs)

    @model_validator(mode="after")
    def _tool_choice_needs_tools(self) -> ChatCompletionRequest:
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                raise ValueError(
                    f"tool_choice: the function {choice.function.name[:100]!r} is not in tools"
                )
        elif choice not in (None, "none") and not self.tools:
            raise ValueError(f"tool_choice: {choice!r} needs tools")
        calls: set[str] = set()  # a tool message answers an earlier call (as OpenAI's)
        for i, m in enumerate(self.messages):
            calls.update(c.id for c in m.tool_calls or [])
            if m.role == "tool" and m.tool_call_id not in calls:
                raise ValueError(
                    f"messages[{i}].tool_call_id: no earlier assistant tool call has the id "
                    f"{str(m.tool_call_id)[:100]!r}"
                )
        return self

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template receives them."""
        if not self.tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]


class TokenizeRequest(RequestBody, ChatTemplateOptions):
    """vLLM's /tokenize: either `prompt` or chat `messages` (rendered as chat renders them:
    continue_final_message, chat_template_kwargs). Our own route: unknown fields are refused
    (a typo gets a 400 rather than a silent default)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for prompt, False for messages
    add_generation_prompt: bool | None = None  # messages only (default True)
    return_token_strs: bool = False
    tools: Tools | None = None  # with messages: rendered by the chat template

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if self.prompt is not None:  # what only a chat template reads: not silently dropped
            for name in ("tools", "add_generation_prompt", "chat_template_kwargs"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name}: applies to messages only, not to prompt")
            if self.continue_final_message:
                raise ValueError("continue_final_message: applies to messages only, not to prompt")
        return self

    def _adds_generation_prompt(self) -> bool:
        """Unset: true with messages (as chat's default)."""
        return self.messages is not None and self.add_generation_prompt is not False


class DetokenizeRequest(RequestBody):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    model: str | None = None
    tokens: Annotated[list[TokenId], Field(max_length=10_000_000)]


class LoadLoRAAdapterRequest(RequestBody):
    """vLLM's POST /v1/load_lora_adapter: serve the PEFT adapter in `lora_path` as model
    `lora_name`."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(RequestBody):
    """vLLM's POST /v1/unload_lora_adapter."""

    lora_name: str
