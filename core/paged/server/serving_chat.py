"""POST /v1/chat/completions."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from paged.engine.outputs import OutputState
from paged.server.errors import APIError
from paged.server.logprobs import Pending, chat_logprobs
from paged.server.protocol import ChatCompletionRequest
from paged.server.serving import (
    Prompt,
    Serving,
    SSEResponse,
    api_error,
    new_id,
    sse,
    sse_error,
    usage,
)


async def create_chat_completion(
    sv: Serving, req: ChatCompletionRequest
) -> dict[str, Any] | SSEResponse:
    sv.check_model(req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs: needs logprobs: true", "top_logprobs")
    if req.response_format is not None and req.response_format.type != "text":
        raise APIError(400, "response_format: not supported yet", "response_format")
    both = req.max_tokens is not None and req.max_completion_tokens is not None
    if both and req.max_tokens != req.max_completion_tokens:
        msg = "max_completion_tokens: give max_tokens or max_completion_tokens, not both"
        raise APIError(400, msg, "max_completion_tokens")
    max_tokens = req.max_completion_tokens if req.max_tokens is None else req.max_tokens
    params = sv.params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None)
    text, ids = await sv.render_chat(
        req.messages, req.add_generation_prompt, req.template_kwargs()
    )
    prompt = sv.fit(text, ids, params, "messages")
    rid = new_id("chatcmpl")
    if req.stream:
        return SSEResponse(_stream(sv, req, rid, prompt))
    return await _full(sv, req, rid, prompt)


def _head(sv: Serving, rid: str, obj: str) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": int(time.time()), "model": sv.model_name}


async def _full(
    sv: Serving, req: ChatCompletionRequest, rid: str, prompt: Prompt
) -> dict[str, Any]:
    states: dict[int, OutputState] = {}
    cached = 0
    try:
        async for _, u in sv.generate(rid, [prompt]):
            states[u.index] = u.state
            if u.index == 0:
                cached = u.output.num_cached_tokens
    except Exception as e:
        raise api_error(e) from None
    k = req.top_logprobs or 0
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": st.out.text},
            "logprobs": chat_logprobs(sv.tokenizer, k, st.out.token_ids, st.out.logprobs or [])
            if req.logprobs
            else None,
            "finish_reason": st.out.finish_reason,
            "stop_reason": st.out.stop_reason,
        }
        for i, st in sorted(states.items())
    ]
    completion = sum(len(st.out.token_ids) for st in states.values())
    return _head(sv, rid, "chat.completion") | {
        "choices": choices,
        "usage": usage(len(prompt.ids), completion, cached),
    }


async def _stream(
    sv: Serving, req: ChatCompletionRequest, rid: str, prompt: Prompt
) -> AsyncIterator[str]:
    head = _head(sv, rid, "chat.completion.chunk")
    with_usage = req.stream_options is not None and req.stream_options.include_usage
    every_chunk = req.stream_options is not None and req.stream_options.continuous_usage_stats
    extra = {"usage": None} if with_usage else {}

    pending = Pending()

    def chunk(index: int, delta: dict[str, Any], reason: str | None = None, stop: Any = None):
        lp = None
        if req.logprobs:
            lp = chat_logprobs(sv.tokenizer, req.top_logprobs or 0, *pending.take(index))
        c = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}
        if reason is not None:
            c["stop_reason"] = stop
        if every_chunk:  # continuous_usage_stats: the usage so far in every chunk
            return sse(head | {"choices": [c], "usage": usage(len(prompt.ids), completion, cached)})
        return sse(head | {"choices": [c]} | extra)

    completion, cached = 0, 0
    started: set[int] = set()
    try:
        async for _, u in sv.generate(rid, [prompt]):
            if u.index not in started:  # the role with the first token, as vLLM sends it
                started.add(u.index)
                yield chunk(u.index, {"role": "assistant", "content": ""})
            eo = u.output
            completion += len(eo.new_token_ids)
            if u.index == 0:
                cached = eo.num_cached_tokens
            pending.add(u.index, eo.new_token_ids, eo.logprobs)
            delta, out = u.state.text_delta(), u.state.out
            if u.state.finished:
                body = {"content": delta} if delta else {}
                yield chunk(u.index, body, out.finish_reason, out.stop_reason)
            elif delta:
                yield chunk(u.index, {"content": delta})
        if with_usage:
            yield sse(head | {"choices": [], "usage": usage(len(prompt.ids), completion, cached)})
    except Exception as e:
        yield sse_error(e)
    yield "data: [DONE]\n\n"
