"""POST /v1/completions."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from paged.engine.outputs import OutputState, with_best_of_logprobs
from paged.server.beam import beam_response, check_beam_request, run_beam_search
from paged.server.errors import APIError
from paged.server.logprobs import CompletionLogprobs, Pending, join_logprobs, prompt_logprobs
from paged.server.protocol import CompletionRequest
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
    truncate,
    truncation,
    usage,
)

MAX_SEQUENCES = 1024  # prompts x n (or best_of) in one request


async def create_completion(sv: Serving, req: CompletionRequest) -> dict[str, Any] | SSEResponse:
    sv.check_model(req.model, req.user)
    if req.suffix is not None:
        msg = "suffix: not supported: this model has no fill-in-the-middle template"
        raise APIError(400, msg, "suffix")
    if req.best_of is not None and req.best_of < req.n:
        raise APIError(400, f"best_of: must be at least n ({req.n})", "best_of")
    if req.stream and req.best_of is not None and req.best_of > req.n:
        raise APIError(400, "best_of: not supported with stream (as in vLLM)", "best_of")
    check_beam_request(req)
    params = with_best_of_logprobs(sv.params(req, req.max_tokens, req.logprobs))
    constraint = constraint_field(req, params)
    raw = req.prompt
    if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
        raw = [raw]  # type: ignore[list-item]
    if len(raw) * params.num_sequences > MAX_SEQUENCES:
        msg = f"prompt: at most {MAX_SEQUENCES} sequences (prompts x n) per request"
        raise APIError(400, msg, "prompt")
    keep = truncation(sv, req.truncate_prompt_tokens)
    prompts = []
    for p in raw:
        text = p if isinstance(p, str) else None
        if isinstance(p, str):
            if not p:
                raise APIError(400, "prompt: must not be empty", "prompt")
            ids = await sv.tokenize(p, "prompt", req.add_special_tokens)
        else:
            ids = list(p)
        text, ids = truncate(text, ids, keep)
        prompts.append(sv.fit(text, ids, params, "prompt", constraint))
    rid = new_id("cmpl")
    if req.use_beam_search:
        return await _beam(sv, req, rid, prompts)
    if req.stream:  # the engine's first update in: its refusal is a 4xx, not an event
        updates = await sv.stream(rid, prompts)
        return SSEResponse(_stream(sv, req, rid, prompts, updates))
    return await _full(sv, req, rid, prompts)


async def _beam(
    sv: Serving, req: CompletionRequest, rid: str, prompts: list[Prompt]
) -> dict[str, Any]:
    """use_beam_search: each prompt's n best beams, prompt by prompt in the choices."""
    found = await asyncio.gather(*(run_beam_search(sv, rid, p, req) for p in prompts))
    parts = [beam_response(sv, req, rid, p, beams, False) for p, beams in zip(prompts, found)]
    out = parts[0]
    out["choices"] = [c | {"index": k * req.n + c["index"]}
                      for k, part in enumerate(parts) for c in part["choices"]]  # fmt: skip
    out["usage"] = usage(
        sum(len(p.ids) for p in prompts),
        sum(part["usage"]["completion_tokens"] for part in parts),
        0,
    )
    return out


def _prompt_text(sv: Serving, p: Prompt) -> str:
    if p.text is not None:
        return p.text
    return sv.tokenizer.decode(p.ids) if sv.tokenizer is not None else ""


def _head(sv: Serving, rid: str) -> dict[str, Any]:
    created = int(time.time())
    return {"id": rid, "object": "text_completion", "created": created, "model": sv.model_name}


def _best(states: list[OutputState], n: int) -> list[OutputState]:
    """best_of: the n sequences of highest cumulative logprob (all of them otherwise)."""
    if len(states) == n:
        return states
    return sorted(states, key=lambda st: -(st.out.cumulative_logprob or 0.0))[:n]


def _prompt_lps(states: list[OutputState]) -> OutputState | None:
    """The sequence that carries its prompt's prompt_logprobs (the one that computed it)."""
    return next((st for st in states if st.prompt_logprobs is not None), None)


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
        seqs = [st for (pk, _), st in sorted(states.items()) if pk == k]
        echo = _prompt_text(sv, p) if req.echo else ""
        plp = _prompt_lps(seqs)
        for i, st in enumerate(_best(seqs, n)):
            out, lps = st.out, None
            if req.logprobs is not None:
                lp = CompletionLogprobs(sv.tokenizer, req.logprobs)
                if req.echo and plp is not None:
                    lps = lp.make_prompt(p.ids, plp.prompt_logprobs)
                gen = lp.make(out.token_ids, out.logprobs or [])
                lps = join_logprobs(lps, gen) if lps is not None else gen
            choice = {
                "index": k * n + i,
                "text": echo + out.text,
                "logprobs": lps,
                "finish_reason": out.finish_reason,
                "stop_reason": out.stop_reason,
            }
            if req.prompt_logprobs is not None and plp is not None:
                choice["prompt_logprobs"] = prompt_logprobs(
                    sv.tokenizer, p.ids, plp.prompt_logprobs, plp.prompt_ranks
                )
            choices.append(choice)
    completion = sum(len(st.out.token_ids) for st in states.values())
    prompt_tokens = sum(len(p.ids) for p in prompts)
    return _head(sv, rid) | {
        "choices": choices,
        "usage": usage(prompt_tokens, completion, sum(cached)),
    }


async def _stream(
    sv: Serving,
    req: CompletionRequest,
    rid: str,
    prompts: list[Prompt],
    updates: Updates | None = None,
) -> AsyncIterator[str]:
    """`updates`: Serving.stream's (default: generated here)."""
    n, head = req.n, _head(sv, rid)
    opts = req.stream_options
    with_usage = opts is not None and opts.include_usage
    every_chunk = opts is not None and opts.continuous_usage_stats
    prompt_tokens = sum(len(p.ids) for p in prompts)
    completion, cached = 0, [0] * len(prompts)

    num_lps = req.logprobs
    lps = {i: CompletionLogprobs(sv.tokenizer, num_lps or 0) for i in range(n * len(prompts))}
    pending = Pending()
    plps: dict[int, OutputState] = {}  # prompt -> the sequence with its prompt_logprobs
    started: set[int] = set()  # choices whose first chunk went out

    def chunk(index: int, text: str, reason: str | None = None, stop: Any = None, **kw) -> str:
        lp = kw.pop("logprobs", None)
        if num_lps is not None and lp is None:
            lp = lps[index].make(*pending.take(index))
        c = {"index": index, "text": text, "logprobs": lp, "finish_reason": reason}
        c["stop_reason"] = stop
        body = head | {"choices": [c | kw]}
        if with_usage or every_chunk:
            u = usage(prompt_tokens, completion, sum(cached)) if every_chunk else None
            body["usage"] = u
        return sse(body)

    def first_chunk(k: int, index: int) -> str | None:
        """A choice's echoed prompt (with its logprobs) and prompt_logprobs, if asked."""
        st, extra = plps.get(k), {}
        if req.prompt_logprobs is not None and st is not None:
            ids = prompts[k].ids
            extra["prompt_logprobs"] = prompt_logprobs(
                sv.tokenizer, ids, st.prompt_logprobs, st.prompt_ranks
            )
        if req.echo:
            lp = None
            if num_lps is not None and st is not None:
                lp = lps[index].make_prompt(prompts[k].ids, st.prompt_logprobs)
            return chunk(index, _prompt_text(sv, prompts[k]), logprobs=lp, **extra)
        return chunk(index, "", **extra) if extra else None

    try:
        wait_for_prompt = req.prompt_logprobs is not None or (req.echo and num_lps is not None)
        if req.echo and not wait_for_prompt:  # nothing to wait for: the prompt goes first
            for k in range(len(prompts)):
                for i in range(n):
                    started.add(k * n + i)
                    yield chunk(k * n + i, _prompt_text(sv, prompts[k]))
        async for k, u in updates or sv.generate(rid, prompts):
            eo, index = u.output, k * n + u.index
            kept = u.state.kept  # a stop string inside several new tokens ends them there
            completion += kept
            if u.index == 0:
                cached[k] = eo.num_cached_tokens
            if u.state.prompt_logprobs is not None:
                plps.setdefault(k, u.state)
            if index not in started:
                started.add(index)
                first = first_chunk(k, index)
                if first is not None:
                    yield first
            pending.add(index, eo.new_token_ids[:kept], eo.logprobs and eo.logprobs[:kept])
            delta, out = u.state.text_delta(), u.state.out
            if u.state.finished:
                yield chunk(index, delta, out.finish_reason, out.stop_reason)
            elif delta:
                yield chunk(index, delta)
        if with_usage:
            yield sse(
                head | {"choices": [], "usage": usage(prompt_tokens, completion, sum(cached))}
            )
    except Exception as e:
        yield sse_error(e)
    yield "data: [DONE]\n\n"
