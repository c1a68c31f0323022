"""What completions, chat and tokenize share: checks, prompt fitting, fan-in, SSE framing."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, TypeVar

from starlette.responses import StreamingResponse

from paged.engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineStepError,
    ReplicaLostError,
    SeqUpdate,
)
from paged.engine.generation_config import apply_defaults
from paged.lora.request import LoRARequest
from paged.sampling.params import SamplingParams
from paged.server.chat_parsing import ParsingOptions
from paged.server.errors import APIError, bad_request
from paged.server.lora_adapters import CURRENT as CURRENT_LORA
from paged.server.lora_adapters import LoRAAdapters
from paged.server.protocol import ChatMessage, SamplingRequest

if TYPE_CHECKING:
    from paged.engine.replicas import ReplicaSet

log = logging.getLogger("paged.server")
# The end user the current request named (OpenAI's `user`, Anthropic's metadata.user_id): set
# by Serving.check_model, read by Serving.fit into the request's Prompt (as the LoRA adapter).
CURRENT_USER: ContextVar[str | None] = ContextVar("paged_user", default=None)
# The model name the current request used (a served name or an adapter): what it reports
CURRENT_MODEL: ContextVar[str | None] = ContextVar("paged_model", default=None)
T = TypeVar("T")
Updates = AsyncIterator[tuple[int, SeqUpdate]]  # (prompt index, update): Serving.generate's
CHARS_PER_TOKEN = 32  # default prompt-size bound: far above any tokenizer's real ratio
# The request fields that ask for structured outputs (protocol.py), as the client spelled them.
STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex",
                     "guided_choice", "guided_grammar")  # fmt: skip


# json.dumps with options builds a JSONEncoder per call; a shared one writes the same text, a
# fifth faster (every streamed chunk goes through here)
_sse_json = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def sse(obj: Any) -> str:
    return f"data: {_sse_json(obj)}\n\n"


def sse_error(e: BaseException) -> str:
    """The error event that ends a stream (then `data: [DONE]`)."""
    err = api_error(e)
    return sse({"error": {"message": err.message, "type": err.type, "param": err.param,
                          "code": err.code}})  # fmt: skip


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def api_error(e: BaseException) -> APIError:
    """The client-facing error for an exception raised while generating."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, ValueError):
        return bad_request(e)
    if isinstance(e, ReplicaLostError):  # the set restarts it; the others serve meanwhile
        return APIError(503, f"the replica running this request stopped ({e}); retry it")
    if isinstance(e, EngineDeadError):
        return APIError(503, f"the engine is not running ({e}); the server is exiting")
    if isinstance(e, EngineStepError):
        log.error("engine step failed: %s", e)
        return APIError(500, "the engine failed while running this request")
    log.error("unexpected error while generating: %r", e)
    return APIError(500, f"internal server error ({type(e).__name__})")


def structured_field(req: SamplingRequest) -> str | None:
    """The field by which the request asked for a structured output (None: none did)."""
    for f in STRUCTURED_FIELDS:
        v = getattr(req, f, None)
        if v is not None and not (f == "response_format" and v.type == "text"):
            return f
    return None


def constraint_field(req: SamplingRequest, params: SamplingParams) -> str | None:
    """The field that constrains the output's tokens, as the client sent it (guided_choice,
    structured_outputs.grammar, ...): the engine names it `structured_outputs` in a refusal
    (a grammar that does not compile, no token that can continue), whatever the client sent."""
    sp = params.structured_outputs
    if sp is None:  # masks without a grammar: only bad words need the engine's tokenizer
        return "bad_words" if params.bad_words else None
    f = structured_field(req)
    if f is None:  # chat's required or named tool choice (serving_chat._adjust)
        return "tool_choice"
    if f == "response_format":
        return "response_format.json_schema.schema" if sp.kind == "json" else f
    return f"structured_outputs.{sp.kind}" if f == "structured_outputs" else f


def as_sent(e: ValueError, constraint: str | None) -> APIError:
    """An engine refusal as a 400 naming the field as the client sent it (`constraint`
    for the engine's structured_outputs, see constraint_field)."""
    err = bad_request(e)
    p = err.param or ""
    if p == "adapter":  # the engine's check of the adapter the request's `model` named
        why = err.message[len(p) :]
        return APIError(400, f"model: the LoRA adapter does not fit{why}", "model")
    if constraint and (p == "structured_outputs" or p.startswith("structured_outputs.")):
        return APIError(400, constraint + err.message[len(p) :], constraint)
    return err


def truncation(sv: Serving, keep: int | None) -> int | None:
    """truncate_prompt_tokens (completions and chat) as the number of prompt tokens kept: -1
    is the model's maximum context length (as on /v1/embeddings; such a prompt leaves no room
    for the output, and Serving.fit refuses it naming the prompt's field), more than that a
    400."""
    if keep == -1:
        return sv.max_model_len
    if keep is not None and keep > sv.max_model_len:
        msg = (
            f"truncate_prompt_tokens: {keep} is more than the model's maximum context length "
            f"({sv.max_model_len} tokens)"
        )
        raise APIError(400, msg, "truncate_prompt_tokens")
    return keep


def truncate(text: str | None, ids: list[int], keep: int | None) -> tuple[str | None, list[int]]:
    """The prompt's last `keep` tokens (left truncation, as vLLM's), its text then unknown."""
    if keep is not None and len(ids) > keep:
        return None, ids[-keep:]
    return text, ids


@dataclasses.dataclass
class Prompt:
    text: str | None
    ids: list[int]
    params: SamplingParams  # max_tokens fitted to this prompt
    lora: LoRARequest | None = None  # the adapter the request's `model` named
    user: str | None = None  # the end user the request named (its `user` field)
    constraint: str | None = None  # constraint_field: the engine's refusals name it


class Serving:
    def __init__(
        self,
        engine: AsyncEngine | ReplicaSet,  # one engine, or replicas with the same surface
        model_names: str | list[str],  # requests may use any; the first when they name none
        chat_template: str | None,
        max_prompt_chars: int | None = None,
    ) -> None:
        self.engine = engine
        self.model_names = [model_names] if isinstance(model_names, str) else list(model_names)
        self.chat_template = chat_template
        self.created = int(time.time())
        self._max_prompt_chars = max_prompt_chars
        self.parsing = ParsingOptions()  # tool-call and reasoning parsers (server flags)
        self.loras = LoRAAdapters()  # --enable-lora: adapters by name (server/lora_adapters.py)
        # {SamplingParams field: value} for fields a request leaves unset (--generation-config)
        self.generation_defaults: dict[str, Any] = {}
        # Tokenizing and chat templating: never on the event loop (a large prompt would stall
        # every other request and /health).
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="paged-tokenize")

    async def off_loop(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: fn(*args, **kwargs))

    @property
    def max_prompt_chars(self) -> int:
        """The most characters of text one request may ask us to tokenize."""
        return self._max_prompt_chars or CHARS_PER_TOKEN * max(self.max_model_len, 1)

    def check_chars(self, n: int, field: str) -> None:
        limit = self.max_prompt_chars
        if n > limit:
            msg = (
                f"{field}: {n} characters of text, more than this server tokenizes for one "
                f"request ({limit}; the model's maximum context length is "
                f"{self.max_model_len} tokens; --max-prompt-chars)"
            )
            raise APIError(400, msg, field, "context_length_exceeded")

    async def tokenize(self, text: str, field: str, add_special_tokens: bool = True) -> list[int]:
        tok = self.need_tokenizer(field)
        self.check_chars(len(text), field)
        enc = await self.off_loop(tok, text, add_special_tokens=add_special_tokens)
        return enc.input_ids

    @property
    def model_name(self) -> str:
        """The name responses report: the one the current request used, a served name or a
        LoRA adapter (as vLLM), else the first served name."""
        return CURRENT_MODEL.get() or self.model_names[0]

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.info["max_model_len"] if self.engine.info else 0

    # ---- checks ------------------------------------------------------------------------
    def check_ready(self) -> None:
        if self.engine.dead is not None:
            msg = f"the engine is not running ({self.engine.dead}); the server is exiting"
            raise APIError(503, msg)
        if not self.engine.ready:
            raise APIError(503, "the engine is starting; retry when /health answers 200")

    def check_model(self, name: str | None, user: str | None = None) -> None:
        """404 unless `name` is one of the model's names or a LoRA adapter (none or "": the
        model). The adapter it names and the end `user` are this request's: the prompts `fit`
        builds next run with the adapter and name the user in the request log and trace."""
        self.check_ready()
        lora = self.loras.get(name)
        CURRENT_LORA.set(lora)
        CURRENT_USER.set(user)
        if name and name not in self.model_names and lora is None:
            raise APIError(
                404, f"model: the model {name[:100]!r} does not exist", "model", "model_not_found"
            )
        CURRENT_MODEL.set(name or None)

    def check_ids(self, ids: list[int], field: str) -> None:
        vocab = self.engine.info["vocab_size"]
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            msg = f"{field}: token id {bad} is out of vocabulary (vocabulary size {vocab})"
            raise APIError(400, msg, field)

    def need_tokenizer(self, field: str) -> Any:
        if self.tokenizer is None:
            raise APIError(400, f"{field}: this model has no tokenizer; send token ids", field)
        return self.tokenizer

    def params(
        self, req: SamplingRequest, max_tokens: int | None, logprobs: int | None = None
    ) -> SamplingParams:
        try:
            p = req.sampling_params(max_tokens, logprobs)
        except (TypeError, ValueError) as e:  # SamplingParams names the field
            raise bad_request(e) from None
        if self.generation_defaults:  # the model's defaults for what the request leaves unset
            unset = {k for k in self.generation_defaults if getattr(req, k, None) is None}
            try:
                p = apply_defaults(p, self.generation_defaults, unset)
            except (TypeError, ValueError) as e:  # SamplingParams names the field
                raise bad_request(e) from None
        self.check_ids(p.stop_token_ids or [], "stop_token_ids")
        self.check_ids(list(p.logit_bias or {}), "logit_bias")
        self.check_ids(p.allowed_token_ids or [], "allowed_token_ids")  # before the engine's pipe
        return p

    def fit(
        self,
        text: str | None,
        ids: list[int],
        params: SamplingParams,
        field: str,
        constraint: str | None = None,
    ) -> Prompt:
        """The prompt with max_tokens fitted to the context, or a 400 with the counts.
        `constraint`: the request's constraint_field."""
        limit, n = self.max_model_len, len(ids)
        if n == 0:
            raise APIError(400, f"{field}: must not be empty", field)
        self.check_ids(ids, field)
        code = "context_length_exceeded"
        if n >= limit:
            msg = (
                f"{field}: this model's maximum context length is {limit} tokens, but the "
                f"prompt has {n} tokens (at least one must be left for the output)"
            )
            raise APIError(400, msg, field, code)
        want = params.max_tokens
        if want is not None and n + want > limit:
            msg = (
                f"max_tokens: this model's maximum context length is {limit} tokens, but "
                f"{n + want} were requested ({n} in the prompt, {want} in the completion); "
                "reduce the prompt or max_tokens"
            )
            raise APIError(400, msg, "max_tokens", code)
        if want is None:  # the context left, or the generation config's max_new_tokens
            most = min(limit - n, self.generation_defaults.get("max_tokens") or limit)
            try:  # validates again: min_tokens may now exceed max_tokens
                params = dataclasses.replace(params, max_tokens=most)
            except ValueError as e:
                raise bad_request(e) from None
        return Prompt(text, ids, params, CURRENT_LORA.get(), CURRENT_USER.get(), constraint)

    # ---- chat templates ----------------------------------------------------------------
    async def render_chat(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        add_special_tokens: bool = False,
    ) -> tuple[str, list[int]]:
        """`template_kwargs`: data for the template (continue_final_message, enable_thinking).
        `add_special_tokens`: the tokenizer's (BOS, ...) on top of the template's (vLLM's)."""
        tok = self.need_tokenizer("messages")
        if len(messages) > self.max_model_len:
            msg = (
                f"messages: {len(messages)} messages cannot fit in the model's maximum context "
                f"length of {self.max_model_len} tokens"
            )
            raise APIError(400, msg, "messages", "context_length_exceeded")
        try:
            conv = [m.as_template_input(i) for i, m in enumerate(messages)]
        except ValueError as e:
            raise bad_request(e) from None
        self.check_chars(sum(m.text_length() for m in messages), "messages")
        args = (tok, conv, add_generation_prompt, tools, template_kwargs, add_special_tokens)
        return await self.off_loop(self._render, *args)

    def _render(
        self,
        tok: Any,
        conv: list[dict],
        add_generation_prompt: bool,
        tools: list | None = None,
        template_kwargs: dict[str, Any] | None = None,
        add_special_tokens: bool = False,
    ):
        from paged.engine.chat_render import apply_chat_template  # tools the template drops

        try:
            text = apply_chat_template(
                tok,
                conv,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                chat_template=self.chat_template,
                tool_parser=self.parsing.tool_call_parser,
                **(template_kwargs or {}),
            )
        except Exception as e:  # jinja TemplateError, no template, raise_exception(...)
            msg = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
            msg = f"messages: cannot apply the chat template: {msg}"
            raise APIError(400, msg, "messages") from None
        self.check_chars(len(text), "messages")
        return text, tok(text, add_special_tokens=add_special_tokens).input_ids

    # ---- generation --------------------------------------------------------------------
    async def generate(self, request_id: str, prompts: list[Prompt]) -> Updates:
        """(prompt index, update) from every prompt's request, as they come. The engine's
        refusals raise as APIErrors naming the field as the client sent it."""
        try:
            if len(prompts) == 1:
                p = prompts[0]
                async for u in self.engine.generate(request_id, p.ids, p.params, p.lora, p.user):
                    yield 0, u
                return
            q: asyncio.Queue = asyncio.Queue()

            async def pump(k: int, p: Prompt) -> None:
                try:
                    rid = f"{request_id}-p{k}"
                    async for u in self.engine.generate(rid, p.ids, p.params, p.lora, p.user):
                        q.put_nowait((k, u))
                    q.put_nowait((k, None))
                except BaseException as e:
                    q.put_nowait((k, e))
                    raise

            tasks = [asyncio.create_task(pump(k, p)) for k, p in enumerate(prompts)]
            left = len(tasks)
            try:
                while left:
                    k, item = await q.get()
                    if item is None:
                        left -= 1
                    elif isinstance(item, BaseException):
                        raise item
                    else:
                        yield k, item
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        except ValueError as e:
            raise as_sent(e, prompts[0].constraint) from None

    async def stream(self, request_id: str, prompts: list[Prompt]) -> Updates:
        """`generate` for a streamed response, its first update already in: an error the
        engine finds before it (a model that only pools, a grammar that does not compile,
        constraints no token can continue) raises here, a 4xx before the response head as
        without stream, not an error event after a 200. So the head leaves with the first
        token; errors after it (the engine gone, a constraint broken later) end the stream
        with an error event."""
        updates = self.generate(request_id, prompts)
        try:
            first = await anext(updates, None)
        except Exception as e:
            raise api_error(e) from None
        return _chain(first, updates)


async def _chain(first: tuple[int, SeqUpdate] | None, rest: Updates) -> Updates:
    """`first` (None: nothing came), then the rest."""
    try:
        if first is not None:
            yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()  # type: ignore[attr-defined]


class SSEResponse(StreamingResponse):
    """Server-sent events; the body generator is always closed, so that a client that
    went away aborts its requests however the stream ended. The body starts before the
    response head is written: a body whose request has not reached the engine sends it
    first (the head, uvicorn's access log and the stream's set-up then overlap the engine's
    steps). The routes' bodies come with the engine's first update in (Serving.stream)."""

    media_type = "text/event-stream"

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        body = self.body_iterator
        first = asyncio.ensure_future(anext(body, _END))  # type: ignore[call-overload]
        await asyncio.sleep(0)  # the body runs to its first wait (the engine's outputs)
        self.body_iterator = _started(first, body)  # type: ignore[assignment]
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not first.done():
                first.cancel()
            await asyncio.gather(first, return_exceptions=True)
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            await body.aclose()  # type: ignore[attr-defined]


_END = object()


async def _started(first: asyncio.Future, rest: AsyncIterator[str]) -> AsyncIterator[str]:
    """The body's first item (already being computed), then the rest of it."""
    item = await first
    if item is _END:
        return
    yield item
    async for item in rest:
        yield item
