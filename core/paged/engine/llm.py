"""The offline API, in vLLM's shape: ``LLM(model).generate(prompts, params)``."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from paged.config import EngineConfig
from paged.engine.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from paged.engine.core import EngineCore
from paged.engine.outputs import (
    OutputState,
    RequestMetrics,
    RequestOutput,
    best_of,
    to_logprobs,
    with_best_of_logprobs,
)
from paged.engine.request import Request, sample_params, sequence_ids
from paged.sampling.params import SamplingParams

log = logging.getLogger("paged")

PromptType = str | list[int] | dict[str, Any]


def load_chat_template(template: str | None) -> str | None:
    """A template given as a file path or inline Jinja."""
    if template is None:
        return None
    import os

    if os.path.isfile(template):
        with open(template) as f:
            return f.read()
    return template


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        """`kwargs`: EngineConfig fields, and the platforms' options (``cpu_native=False``)."""
        import dataclasses

        fields = {f.name for f in dataclasses.fields(EngineConfig)}
        options = dict(kwargs.pop("platform_options", None) or {})
        options.update({k: kwargs.pop(k) for k in list(kwargs) if k not in fields})
        self.config = EngineConfig(model=model, **kwargs, platform_options=options)
        self.engine = EngineCore(self.config)
        self.tokenizer = None
        if self.engine.source is not None:
            from paged.model.loader import load_tokenizer

            try:
                self.tokenizer = load_tokenizer(self.engine.source, self.config.tokenizer)
            except Exception as e:  # a weights-only directory: token-id prompts still work
                log.warning("no tokenizer (%s): only token-id prompts will work", e)
        self.chat_template = load_chat_template(self.config.chat_template)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.tokenizer

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass token ids")
            return prompt, self.tokenizer(prompt).input_ids
        return None, list(prompt)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str | dict) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        return self._run([self._tokenize(p) for p in prompts], sampling_params, use_tqdm)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """vLLM's offline beam search (paged.engine.beam_search): per prompt, the beam_width
        best sequences, best first (tokens hold the prompt and the output)."""
        if isinstance(prompts, str | dict) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        eng = self.engine
        searches = [
            BeamSearch(self._tokenize(p)[1], params, eng.eos_token_ids, eng.max_model_len)
            for p in prompts
        ]
        bar = tqdm(total=params.max_tokens, desc="Beam search", disable=not use_tqdm)
        while live := [s for s in searches if not s.done]:
            step = [(None, beam.tokens) for s in live for beam in s.live]
            outs = iter(self._run(step, live[0].step_params(), use_tqdm=False))
            for s in live:
                entries = [next(outs).outputs[0].logprobs[0] for _ in s.live]
                s.advance([{t: lp.logprob for t, lp in e.items()} for e in entries])
            bar.update(1)
        bar.close()
        return [s.result(self.tokenizer) for s in searches]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """`continue_final_message`: leave the last (assistant) message open for the model to
        continue (with add_generation_prompt=False); `chat_template_kwargs`: template variables."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message: needs add_generation_prompt=False")
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conv in convs:
            text = self.tokenizer.apply_chat_template(
                conv,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                chat_template=load_chat_template(chat_template) or self.chat_template,
                continue_final_message=continue_final_message,
                **(chat_template_kwargs or {}),
            )
            prompts.append((text, self.tokenizer(text, add_special_tokens=False).input_ids))
        return self._run(prompts, sampling_params, use_tqdm)

    def _run(
        self,
        prompts: list[tuple[str | None, list[int]]],
        params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("sampling_params: one per prompt, or a single one for all")
        results: dict[str, RequestOutput] = {}
        states: dict[str, tuple[str, OutputState]] = {}
        seqs: dict[str, Request] = {}  # the engine's, for their timings
        order = []
        try:
            for (text, ids), p in zip(prompts, params):
                rid = str(next(self._ids))
                order.append(rid)
                results[rid] = RequestOutput(rid, text, ids, [])
                p = with_best_of_logprobs(p)
                self.engine.add_request(rid, ids, p)  # n sequences, one prompt computed
                for i, cid in enumerate(sequence_ids(rid, p.num_sequences)):
                    st = OutputState(i, self.tokenizer, ids, sample_params(p, i))
                    results[rid].outputs.append(st.out)
                    states[cid] = (rid, st)
                    seqs[cid] = self.engine.requests[cid]
        except Exception:
            self.engine.abort(list(states))  # nothing half-submitted stays in the engine
            raise
        pending = {rid: len(results[rid].outputs) for rid in order}
        bar = tqdm(total=len(order), desc="Processed prompts", disable=not use_tqdm)
        try:
            while self.engine.has_unfinished():
                for eo in self.engine.step():
                    rid, st = states[eo.request_id]
                    if eo.error:
                        raise RuntimeError(f"request {rid} failed: {eo.error}")
                    if st.update(eo):
                        self.engine.abort([eo.request_id])
                    results[rid].num_cached_tokens = eo.num_cached_tokens
                    if st.finished:
                        pending[rid] -= 1
                        if pending[rid] == 0:
                            results[rid].finished = True
                            bar.update(1)
        finally:
            bar.close()
            self.engine.abort(list(states))
        by_rid: dict[str, list[tuple[OutputState, Request]]] = {}
        for cid, (rid, st) in states.items():
            by_rid.setdefault(rid, []).append((st, seqs[cid]))
        for rid, p in zip(order, params):
            self._finalize(results[rid], by_rid[rid])
            results[rid].outputs = best_of(results[rid].outputs, p)
        return [results[rid] for rid in order]

    def _finalize(self, res: RequestOutput, seqs: list[tuple[OutputState, Request]]) -> None:
        """vLLM's Logprob values, prompt_logprobs and the request's timings."""
        tok = self.tokenizer
        for st, _ in seqs:
            if st.out.logprobs is not None:
                st.out.logprobs = to_logprobs(st.out.logprobs, st.ranks, st.out.token_ids, tok)
        done = [st for st, _ in seqs if st.prompt_logprobs is not None]
        if done and len(done[0].prompt_logprobs) == len(res.prompt_token_ids) - 1:
            st = done[0]
            ids = res.prompt_token_ids[1:]
            res.prompt_logprobs = [
                None,
                *to_logprobs(st.prompt_logprobs, st.prompt_ranks, ids, tok),
            ]
        reqs = [r for _, r in seqs]

        def first(name: str) -> float | None:
            return min((getattr(r, name) for r in reqs if getattr(r, name)), default=None)

        scheduled, ended = first("first_scheduled_time"), [r.finished_time for r in reqs]
        arrival = first("arrival_time")
        res.metrics = RequestMetrics(
            arrival_time=arrival,
            last_token_time=max((t for t in ended if t), default=None),
            first_scheduled_time=scheduled,
            first_token_time=first("first_token_time"),
            time_in_queue=None if scheduled is None else scheduled - arrival,
            finished_time=max((t for t in ended if t), default=None),
        )
