"""POST /v1/completions."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from paged.engine.outputs import OutputState
from paged.server.errors import APIError
from paged.server.logprobs import CompletionLogprobs, Pending
from paged.server.protocol import CompletionRequest
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

MAX_SEQUENCES = 1024  # prompts x n in one request


def _not_supported(field: str) -> APIError:
    return APIError(400, f"{field}: not supported yet", field)


async def create_completion(sv: Serving, req: CompletionRequest) -> dict[str, Any] | SSEResponse:
    sv.check_model(req.model)
    if req.logprobs is not None and req.echo:
        raise _not_supported("echo")  # with logprobs: that needs prompt logprobs
    if req.best_of is not None and req.best_of != req.n:
        raise _not_supported("best_of")
    if req.suffix:
        raise _not_supported("suffix")
    params = sv.params(req, req.max_tokens, req.logprobs)
    raw = req.prompt
    if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
        raw = [raw]  # type: ignore[list-item]
    if len(raw) * req.n > MAX_SEQUENCES:
        msg = f"prompt: at most {MAX_SEQUENCES} sequences (prompts x n) per request"
        raise APIError(400, msg, "prompt")
    prompts = []
    for p in raw:
        if isinstance(p, str):
            if not p:
                raise APIError(400, "prompt: must not be empty", "prompt")
            ids = await sv.tokenize(p, "prompt")
            prompts.append(sv.fit(p, ids, params, "prompt"))
        else:
            prompts.append(sv.fit(None, list(p), params, "prompt"))
    rid = new_id("cmpl")
    if req.stream:
        return SSEResponse(_stream(sv, req, rid, prompts))
    return await _full(sv, req, rid, prompts)


def _prompt_text(sv: Serving, p: Prompt) -> str:
    if p.text is not None:
        return p.text
    return sv.tokenizer.decode(p.ids) if sv.tokenizer is not None else ""


def _head(sv: Serving, rid: str) -> dict[str, Any]:
    created = int(time.time())
    return {"id": rid, "object": "text_completion", "created": created, "model": sv.model_name}


async def _full(
    sv: Serving, req: CompletionRequest, rid: str, prompts: list[Prompt]
) -> dict[str, Any]:
    n = req.n
    states: dict[tuple[int, int], OutputState] = {}
    cached = [0] * len(prompts)
    try:
        async for k, u in sv.generate(rid, prompts):
            states[(k, u.index)] = u.state
            if u.index == 0:
                cached[k] = u.output.num_cached_tokens
    except Exception as e:
        raise api_error(e) from None
    choices = []
    for k, p in enumerate(prompts):
        echo = _prompt_text(sv, p) if req.echo else ""
        for i in range(n):
            out = states[(k, i)].out
            lps = None
            if req.logprobs is not None:
                lps = CompletionLogprobs(sv.tokenizer, req.logprobs)
                lps = lps.make(out.token_ids, out.logprobs or [])
            choices.append(
                {
                    "index": k * n + i,
                    "text": echo + out.text,
                    "logprobs": lps,
                    "finish_reason": out.finish_reason,
                    "stop_reason": out.stop_reason,
                }
            )
    completion = sum(len(st.out.token_ids) for st in states.values())
    prompt_tokens = sum(len(p.ids) for p in prompts)
    return _head(sv, rid) | {
        "choices": choices,
        "usage": usage(prompt_tokens, completion, sum(cached)),
    }


async def _stream(
    sv: Serving, req: CompletionRequest, rid: str, prompts: list[Prompt]
) -> AsyncIterator[str]:
    n, head = req.n, _head(sv, rid)
    with_usage = req.stream_options is not None and req.stream_options.include_usage
    extra = {"usage": None} if with_usage else {}

    num_lps = req.logprobs
    lps = {i: CompletionLogprobs(sv.tokenizer, num_lps or 0) for i in range(n * len(prompts))}
    pending = Pending()

    def chunk(index: int, text: str, reason: str | None = None, stop: Any = None) -> str:
        lp = None
        if num_lps is not None:
            lp = lps[index].make(*pending.take(index))
        c = {"index": index, "text": text, "logprobs": lp, "finish_reason": reason}
        c["stop_reason"] = stop
        return sse(head | {"choices": [c]} | extra)

    completion, cached = 0, [0] * len(prompts)
    try:
        if req.echo:
            for j, prompt in enumerate(prompts):
                text = _prompt_text(sv, prompt)
                for i in range(n):
                    yield chunk(j * n + i, text)
        async for p, u in sv.generate(rid, prompts):
            eo, index = u.output, p * n + u.index
            completion += len(eo.new_token_ids)
            if u.index == 0:
                cached[p] = eo.num_cached_tokens
            pending.add(index, eo.new_token_ids, eo.logprobs)
            delta, out = u.state.text_delta(), u.state.out
            if u.state.finished:
                yield chunk(index, delta, out.finish_reason, out.stop_reason)
            elif delta:
                yield chunk(index, delta)
        if with_usage:
            prompt_tokens = sum(len(p.ids) for p in prompts)
            yield sse(
                head | {"choices": [], "usage": usage(prompt_tokens, completion, sum(cached))}
            )
    except Exception as e:
        yield sse_error(e)
    yield "data: [DONE]\n\n"
