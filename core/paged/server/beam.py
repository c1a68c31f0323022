"""use_beam_search on completions and chat: vLLM's beam search (paged.engine.beam_search), each
step one single-token request per live beam through the engine; n is the beam width."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from paged.engine.beam_search import (
    MAX_BEAM_WIDTH,
    BeamSearch,
    BeamSearchParams,
    BeamSearchSequence,
)
from paged.server.errors import APIError
from paged.server.protocol import SamplingRequest
from paged.server.serving import Prompt, Serving, api_error, usage

# Fields a beam-search request may set; any other is a 400 naming it (it would have no effect).
BEAM_FIELDS = frozenset(
    ("model", "prompt", "messages", "n", "max_tokens", "max_completion_tokens", "temperature",
     "use_beam_search", "length_penalty", "ignore_eos", "skip_special_tokens", "user",
     "add_generation_prompt", "continue_final_message", "chat_template_kwargs",
     "truncate_prompt_tokens", "spaces_between_special_tokens", "add_special_tokens")
)  # fmt: skip


def check_beam_request(req: SamplingRequest) -> None:
    """400 naming the field for what beam search cannot honour."""
    if not req.use_beam_search:
        if req.length_penalty != 1.0:
            raise APIError(400, "length_penalty: only with use_beam_search", "length_penalty")
        return
    if req.stream:
        raise APIError(400, "use_beam_search: not supported with stream", "use_beam_search")
    if req.n > MAX_BEAM_WIDTH:
        msg = f"n: the beam width, at most {MAX_BEAM_WIDTH} with use_beam_search"
        raise APIError(400, msg, "n")
    if req.temperature:
        msg = "temperature: beams rank by the raw logprobs; leave it 0 with use_beam_search"
        raise APIError(400, msg, "temperature")
    fields = type(req).model_fields  # a field sent with its default value changes nothing
    sent = req.model_fields_set - BEAM_FIELDS
    extra = sorted(f for f in sent if getattr(req, f) != fields[f].default)
    if extra:
        raise APIError(400, f"{extra[0]}: not supported with use_beam_search", extra[0])


async def run_beam_search(
    sv: Serving, rid: str, prompt: Prompt, req: SamplingRequest
) -> list[BeamSearchSequence]:
    """The n best beams of the prompt, best first."""
    p = prompt.params
    params = BeamSearchParams(req.n, p.max_tokens, p.ignore_eos, 0.0, req.length_penalty)
    eos = tuple((sv.engine.info or {}).get("eos_token_ids", ()))
    search = BeamSearch(prompt.ids, params, eos, sv.max_model_len)
    step_params = search.step_params()

    async def expand(step: int, i: int, tokens: list[int]) -> dict[int, float]:
        last = None
        beam = f"{rid}-s{step}-b{i}"
        async for u in sv.engine.generate(beam, tokens, step_params, prompt.lora, prompt.user):
            last = u.output
        return last.logprobs[0]

    try:
        while not search.done:
            beams = search.live
            tasks = (expand(search.steps, i, b.tokens) for i, b in enumerate(beams))
            search.advance(list(await asyncio.gather(*tasks)))
    except Exception as e:
        raise api_error(e) from None
    return search.result(None).sequences


def _text(sv: Serving, seq: BeamSearchSequence, num_prompt: int, req: SamplingRequest) -> str:
    """The beam's output text; an EOS that ended it is left out unless
    include_stop_str_in_output (as sampled sequences' text)."""
    out = seq.tokens[num_prompt:]
    if seq.finish_reason == "stop" and out and not req.include_stop_str_in_output:
        out = out[:-1]
    if sv.tokenizer is None:
        return ""
    return sv.tokenizer.decode(out, skip_special_tokens=req.skip_special_tokens)


def beam_response(
    sv: Serving, req: SamplingRequest, rid: str, prompt: Prompt, beams: list, chat: bool
) -> dict[str, Any]:
    """A completion or chat completion whose choices are the beams, best first."""
    n = len(prompt.ids)
    choices = []
    for i, seq in enumerate(beams):
        text = _text(sv, seq, n, req)
        c: dict[str, Any] = {"index": i}
        if chat:
            c["message"] = {"role": "assistant", "content": text}
        else:
            c["text"] = text
        c |= {"logprobs": None, "finish_reason": seq.finish_reason, "stop_reason": None}
        choices.append(c)
    head = {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": sv.model_name,
    }
    completion = sum(len(s.tokens) - n for s in beams)
    return head | {"choices": choices, "usage": usage(n, completion, 0)}
