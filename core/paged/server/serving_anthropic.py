"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API on the chat
machinery (output_blocks.py), with its response shape, stream events and error bodies."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError

from paged.engine.async_engine import SeqUpdate
from paged.server.anthropic_protocol import CountTokensRequest, MessagesRequest
from paged.server.errors import APIError
from paged.server.output_blocks import (
    Block,
    BlockStream,
    Event,
    final_update,
    full_blocks,
    hex_id,
    named_sse,
    prepare,
    renamed,
    stream_events,
)
from paged.server.protocol import ChatCompletionRequest
from paged.server.serving import Prompt, Serving, SSEResponse, Updates, api_error

PATH = "/v1/messages"
NAMES = {  # chat's field names (regular expressions) -> this API's
    r"stop": "stop_sequences",
    r"response_format\.json_schema\.schema": "output_config.format.schema",
    r"response_format": "output_config",
    r"tools\[(\d+)\]\.function\.parameters": r"tools[\1].input_schema",
    r"tools\[(\d+)\]\.function\.name": r"tools[\1].name",
}
# HTTP status -> Anthropic's error type (https://docs.anthropic.com/en/api/errors).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_body(status: int, message: str) -> dict[str, Any]:
    return {
        "type": "error",
        "error": {"type": ERROR_TYPES.get(status, "invalid_request_error"), "message": message},
    }


def _chat(req: CountTokensRequest, sv: Serving) -> ChatCompletionRequest:
    try:
        if isinstance(req, MessagesRequest):
            return req.to_chat(sv.parsing.reasoning_parser)
        return req.chat_request(sv.parsing.reasoning_parser)
    except ValidationError as e:
        err = e.errors()[0]
        raise APIError(400, f"body: {err.get('msg', 'invalid request')}", "body") from None
    except ValueError as e:
        raise APIError(400, str(e), str(e).split(":")[0]) from None


async def count_tokens(sv: Serving, req: CountTokensRequest) -> dict[str, Any]:
    sv.check_model(req.model)
    chat = _chat(req, sv)
    try:
        _, ids = await sv.render_chat(
            chat.messages, chat.add_generation_prompt, chat.tool_dicts(), chat.template_kwargs()
        )
    except APIError as e:
        raise renamed(e, NAMES) from None
    return {"input_tokens": len(ids)}


async def create_message(sv: Serving, req: MessagesRequest) -> dict[str, Any] | SSEResponse:
    sv.check_model(req.model, req.metadata.user_id if req.metadata else None)
    chat = _chat(req, sv)
    prompt, parsing = await prepare(sv, chat, NAMES)
    rid = hex_id("msg")
    if req.stream:  # the engine's first update in: its refusal is a 4xx, not an event
        updates = await sv.stream(rid, [prompt])
        return SSEResponse(_stream(sv, rid, prompt, BlockStream(parsing, "toolu"), updates))
    u, cached = await final_update(sv, rid, prompt)
    blocks, called = full_blocks(parsing, u.state.out.text, "toolu")
    return (
        _message(sv, rid, [_block(b) for b in blocks])
        | _stop(u, called)
        | {"usage": _usage(len(prompt.ids), len(u.state.out.token_ids), cached)}
    )


def _message(sv: Serving, rid: str, content: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "id": rid,
        "type": "message",
        "role": "assistant",
        "content": content,
        "model": sv.model_name,
    }


def _stop(u: SeqUpdate, called: bool) -> dict[str, Any]:
    """stop_reason and stop_sequence of a finished output."""
    out = u.state.out
    if out.finish_reason == "length":  # a cut tool_use too, as Anthropic and chat's "length"
        return {"stop_reason": "max_tokens", "stop_sequence": None}
    if called:
        return {"stop_reason": "tool_use", "stop_sequence": None}
    if isinstance(out.stop_reason, str):
        return {"stop_reason": "stop_sequence", "stop_sequence": out.stop_reason}
    return {"stop_reason": "end_turn", "stop_sequence": None}


def _usage(prompt: int, output: int, cached: int) -> dict[str, Any]:
    """Anthropic's usage: input_tokens are the prompt's uncached ones (the total input is
    input_tokens + cache_read_input_tokens)."""
    return {
        "input_tokens": prompt - cached,
        "output_tokens": output,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


def _block(b: Block, empty: bool = False) -> dict[str, Any]:
    """A content block; `empty`: as content_block_start sends it, before its deltas."""
    if b.kind == "reasoning":
        return {"type": "thinking", "thinking": "" if empty else b.text, "signature": ""}
    if b.kind == "text":
        return {"type": "text", "text": "" if empty else b.text}
    return {
        "type": "tool_use",
        "id": b.call_id,
        "name": b.name,
        "input": {} if empty else b.tool_input(),
    }


def event(kind: str, body: dict[str, Any]) -> str:
    return named_sse(kind, {"type": kind} | body)


def _delta(e: Event) -> dict[str, Any]:
    if e.block.kind == "reasoning":
        return {"type": "thinking_delta", "thinking": e.delta}
    if e.block.kind == "text":
        return {"type": "text_delta", "text": e.delta}
    return {"type": "input_json_delta", "partial_json": e.delta}


async def _stream(
    sv: Serving, rid: str, prompt: Prompt, blocks: BlockStream, updates: Updates | None = None
) -> AsyncIterator[str]:
    """`updates`: Serving.stream's (default: generated here)."""
    n_prompt = len(prompt.ids)
    start = _message(sv, rid, []) | {"stop_reason": None, "stop_sequence": None}
    yield event("message_start", {"message": start | {"usage": _usage(n_prompt, 0, 0)}})
    yield event("ping", {})
    try:
        async for events, u in stream_events(sv, rid, prompt, blocks, updates):
            for e in events:
                if e.what == "open":
                    yield event(
                        "content_block_start",
                        {"index": e.index, "content_block": _block(e.block, True)},
                    )
                elif e.what == "delta":
                    yield event("content_block_delta", {"index": e.index, "delta": _delta(e)})
                else:
                    if e.block.kind == "reasoning":  # Anthropic closes thinking with a signature
                        sig = {"type": "signature_delta", "signature": ""}
                        yield event("content_block_delta", {"index": e.index, "delta": sig})
                    yield event("content_block_stop", {"index": e.index})
            if u.state.finished:
                usage = _usage(n_prompt, len(u.state.out.token_ids), u.output.num_cached_tokens)
                yield event("message_delta", {"delta": _stop(u, blocks.called), "usage": usage})
        yield event("message_stop", {})
    except Exception as e:
        err = api_error(e)
        yield event("error", {"error": error_body(err.status, err.message)["error"]})


class AnthropicErrors:
    """ASGI middleware: error responses under /v1/messages in Anthropic's shape,
    {"type": "error", "error": {"type", "message"}}, whoever raised them (the API-key and
    body guards, validation, the handlers)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PATH):
            return await self.app(scope, receive, send)
        start: dict[str, Any] | None = None
        chunks: list[bytes] = []

        async def capture(msg: dict[str, Any]) -> None:
            nonlocal start
            if msg["type"] == "http.response.start" and msg["status"] >= 400:
                start = msg
                return
            if start is None:
                return await send(msg)
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body", False):
                await self._send_error(start, b"".join(chunks), send)

        await self.app(scope, receive, capture)

    @staticmethod
    async def _send_error(start: dict[str, Any], body: bytes, send: Any) -> None:
        try:
            message = json.loads(body)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = None
        if message is not None:
            body = json.dumps(error_body(start["status"], message)).encode()
            headers = [
                (k, v)
                for k, v in start.get("headers", [])
                if k.lower() not in (b"content-length", b"content-type")
            ]
            headers += [
                (b"content-length", str(len(body)).encode()),
                (b"content-type", b"application/json"),
            ]
            start = start | {"headers": headers}
        await send(start)
        await send({"type": "http.response.body", "body": body})
