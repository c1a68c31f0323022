"""POST /v1/chat/completions."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from paged.engine.outputs import OutputState
from paged.sampling.params import SamplingParams, StructuredOutputsParams
from paged.sampling.structured import check_spec
from paged.server.beam import beam_response, check_beam_request, run_beam_search
from paged.server.chat_parsing import ChatParsing, ChatStreamer, ParsingOptions
from paged.server.errors import APIError, bad_request
from paged.server.logprobs import Pending, chat_logprobs, prompt_logprobs
from paged.server.protocol import ChatCompletionRequest
from paged.server.serving import (
    Prompt,
    Serving,
    SSEResponse,
    Updates,
    api_error,
    constraint_field,
    new_id,
    sse,
    sse_error,
    structured_field,
    truncate,
    truncation,
    usage,
)


async def create_chat_completion(
    sv: Serving, req: ChatCompletionRequest
) -> dict[str, Any] | SSEResponse:
    sv.check_model(req.model, req.user)
    check_beam_request(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs: needs logprobs: true", "top_logprobs")
    both = req.max_tokens is not None and req.max_completion_tokens is not None
    if both and req.max_tokens != req.max_completion_tokens:
        msg = "max_completion_tokens: give max_tokens or max_completion_tokens, not both"
        raise APIError(400, msg, "max_completion_tokens")
    max_tokens = req.max_completion_tokens if req.max_tokens is None else req.max_tokens
    if req.prompt_logprobs is not None and req.stream:
        msg = "prompt_logprobs: not supported with stream on chat completions"
        raise APIError(400, msg, "prompt_logprobs")
    keep = truncation(sv, req.truncate_prompt_tokens)
    params = sv.params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None)
    text, ids = await sv.render_chat(
        req.messages,
        req.add_generation_prompt,
        req.tool_dicts(),
        req.template_kwargs(),
        req.add_special_tokens,
    )
    parsing = ChatParsing(sv.parsing, req, text)
    params = _adjust(sv, req, parsing, params)
    text, ids = truncate(text, ids, keep)  # the rendered prompt's last `keep` tokens
    prompt = sv.fit(text, ids, params, "messages", constraint_field(req, params))
    rid = new_id("chatcmpl")
    if req.use_beam_search:  # n best beams (server/beam.py)
        beams = await run_beam_search(sv, rid, prompt, req)
        return beam_response(sv, req, rid, prompt, beams, True)
    if req.stream:  # the engine's first update in: its refusal is a 4xx, not an event
        updates = await sv.stream(rid, [prompt])
        return SSEResponse(_stream(sv, req, rid, prompt, parsing, updates))
    return await _full(sv, req, rid, prompt, parsing)


def _adjust(
    sv: Serving, req: ChatCompletionRequest, parsing: ChatParsing, params: SamplingParams
) -> SamplingParams:
    """What tool calling and reasoning change in the sampling: tool_choice "required" or a
    named function is enforced by structured outputs; structured outputs wait for the end of
    the reasoning; tags the tokenizer calls special are kept in the text for the parser."""
    if parsing.schema is not None:
        if params.structured_outputs is not None:
            msg = "tool_choice: a required or named tool choice cannot be combined with "
            msg += structured_field(req) or "structured_outputs"
            raise APIError(400, msg, "tool_choice")
        # Compact JSON: calls are read by programs, and free whitespace lets a model pad
        # without end.
        so = StructuredOutputsParams(json=parsing.schema, disable_any_whitespace=True)
        try:
            check_spec(so, parsing.schema_field)  # an invalid schema names the tool
        except ValueError as e:
            raise bad_request(e) from None
        params = dataclasses.replace(params, structured_outputs=so)
    if params.structured_outputs is not None and parsing.reasoning_end is not None:
        # The reasoning stays free: the grammar starts after the end marker's tokens.
        ids = sv.tokenizer.encode(parsing.reasoning_end, add_special_tokens=False)
        params = dataclasses.replace(params, structured_outputs_after=ids)
    if req.thinking_token_budget is not None and parsing.reasoning is None:
        msg = "thinking_token_budget: needs a server started with --reasoning-parser"
        raise APIError(400, msg, "thinking_token_budget")
    if req.thinking_token_budget is not None and parsing.reasoning_end is not None:
        ids = sv.tokenizer.encode(parsing.reasoning_end, add_special_tokens=False)
        params = dataclasses.replace(
            params, thinking_token_budget=req.thinking_token_budget, reasoning_end_ids=ids
        )
    if params.skip_special_tokens and parsing.keep_special_tokens(sv.tokenizer):
        params = dataclasses.replace(params, skip_special_tokens=False)
    return params


def _message(parsing: ChatParsing, text: str, cut: bool) -> tuple[dict[str, Any], bool]:
    """The non-streamed message, and whether it holds calls. An output cut by the length
    limit inside a call keeps the call as far as it came, as a stream has sent it (its
    arguments then are not valid JSON), with the content before it."""
    if cut:
        cs = parsing.streamer()
        body = cs.feed(text, False)  # the stream's deltas of this text, joined
        if cs.called:
            msg: dict[str, Any] = {"role": "assistant"}
            if parsing.reasoning is not None:
                msg["reasoning_content"] = body.get("reasoning_content")
            msg["content"] = body.get("content")
            msg["tool_calls"] = [
                {"id": c["id"], "type": "function", "function": c["function"]}
                for c in body["tool_calls"]
            ]
            return msg, True
    return parsing.message(text)


def _joined(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two stream delta bodies as one."""
    out = dict(a)
    for k, v in b.items():
        out[k] = out[k] + v if k in out else v
    return out


def _echoed(req: Any) -> str:
    """vLLM's chat `echo`: the content of the last message if it has the reply's role (the
    assistant's: a prefix the reply continues, with continue_final_message), else nothing.
    Text parts are joined as the template receives them."""
    if not getattr(req, "echo", False):
        return ""
    last = req.messages[-1]
    if last.role != "assistant":
        return ""
    if isinstance(last.content, list):
        return "\n".join(p.text or "" for p in last.content)
    return last.content or ""


def _head(sv: Serving, rid: str, obj: str) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": int(time.time()), "model": sv.model_name}


async def _full(
    sv: Serving,
    req: ChatCompletionRequest,
    rid: str,
    prompt: Prompt,
    parsing: ChatParsing | None = None,
) -> dict[str, Any]:
    parsing = parsing or ChatParsing(ParsingOptions(), req, prompt.text)
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
    echo = _echoed(req)
    choices = []
    for i, st in sorted(states.items()):
        message, reason = {"role": "assistant", "content": st.out.text}, st.out.finish_reason
        if parsing.active:
            message, called = _message(parsing, st.out.text, reason == "length")
            if reason != "length":  # as OpenAI: a cut output says so, calls or not
                reason = parsing.finish_reason(called, reason)
        if echo:  # as vLLM: the echoed content, then the reply's
            message["content"] = echo + (message.get("content") or "")
        lps = None
        if req.logprobs:
            lps = chat_logprobs(sv.tokenizer, k, st.out.token_ids, st.out.logprobs or [])
        choices.append({"index": i, "message": message, "logprobs": lps,
                        "finish_reason": reason, "stop_reason": st.out.stop_reason})  # fmt: skip
    completion = sum(len(st.out.token_ids) for st in states.values())
    body = _head(sv, rid, "chat.completion") | {
        "choices": choices,
        "usage": usage(len(prompt.ids), completion, cached),
    }
    plp = next((st for st in states.values() if st.prompt_logprobs is not None), None)
    if getattr(req, "prompt_logprobs", None) is not None and plp is not None:
        body["prompt_logprobs"] = prompt_logprobs(
            sv.tokenizer, prompt.ids, plp.prompt_logprobs, plp.prompt_ranks
        )
    return body


async def _stream(
    sv: Serving,
    req: ChatCompletionRequest,
    rid: str,
    prompt: Prompt,
    parsing: ChatParsing | None = None,
    updates: Updates | None = None,
) -> AsyncIterator[str]:
    """`updates`: Serving.stream's (default: generated here)."""
    parsing = parsing or ChatParsing(ParsingOptions(), req, prompt.text)
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
    streams: dict[int, ChatStreamer] = {}
    echo = _echoed(req)
    try:
        async for _, u in updates or sv.generate(rid, [prompt]):
            if u.index not in started:  # the role with the first token, as vLLM sends it
                started.add(u.index)
                yield chunk(u.index, {"role": "assistant", "content": ""})
                if echo:  # as vLLM: the echoed content in the delta after the role's
                    yield chunk(u.index, {"content": echo})
            eo = u.output
            kept = u.state.kept  # a stop string inside several new tokens ends them there
            completion += kept
            if u.index == 0:
                cached = eo.num_cached_tokens
            pending.add(u.index, eo.new_token_ids[:kept], eo.logprobs and eo.logprobs[:kept])
            delta, out = u.state.text_delta(), u.state.out
            body = {"content": delta} if delta else {}
            if parsing.active:
                cs = streams.setdefault(u.index, parsing.streamer())
                cut = u.state.finished and out.finish_reason == "length"
                body = cs.feed(delta, u.state.finished and not cut)
                if cut and not cs.called:  # no call started: the text as a final parse gives it
                    body = _joined(body, cs.feed("", True))
            if u.state.finished:
                reason = out.finish_reason
                if parsing.active and reason != "length":
                    reason = parsing.finish_reason(streams[u.index].called, reason)
                yield chunk(u.index, body, reason, out.stop_reason)
            elif body:
                yield chunk(u.index, body)
        if with_usage:
            yield sse(head | {"choices": [], "usage": usage(len(prompt.ids), completion, cached)})
    except Exception as e:
        yield sse_error(e)
    yield "data: [DONE]\n\n"
