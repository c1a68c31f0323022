"""The offline API, in vLLM's shape: ``LLM(model).generate(prompts, params)``."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

from jinja2 import TemplateError
from tqdm import tqdm

from paged.config import EngineConfig, read_chat_template
from paged.engine.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from paged.engine.core import EngineCore, EngineOutput
from paged.engine.llm_inputs import (
    check_conversations,
    check_mapping,
    check_prompts,
    check_sampling_params,
    check_tools,
    lora_requests,
)
from paged.engine.outputs import (
    Logprob,
    OutputState,
    RequestMetrics,
    RequestOutput,
    best_of,
    to_logprobs,
    with_best_of_logprobs,
)
from paged.engine.pooling import (
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
)
from paged.engine.pooling import run_offline as run_pooling
from paged.engine.request import Request, sample_params, sequence_ids
from paged.lora.request import LoRARequest
from paged.pooling_params import PoolingParams
from paged.sampling.params import RequestOutputKind, SamplingParams

log = logging.getLogger("paged")

PromptType = str | list[int] | dict[str, Any]


def load_chat_template(template: str | None) -> str | None:
    """A template given as a file path or inline Jinja; ValueError naming chat_template for a
    value without Jinja syntax that is no readable file (paged.config.read_chat_template)."""
    return read_chat_template(template)


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        """`kwargs`: EngineConfig fields, and the platforms' options (``cpu_native=False``)."""
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
            except Exception as e:
                if self.config.tokenizer is not None:  # the one asked for: never run without
                    raise ValueError(f"tokenizer: {e}") from e
                # a weights-only directory: token-id prompts still work
                log.warning("no tokenizer (%s): only token-id prompts will work", e)
        self.chat_template = load_chat_template(self.config.chat_template)
        self._ids = itertools.count()
        self._defaults: dict[str, Any] | None = None  # of the generation config
        # Each running request's (sequence id's) owner: the inbox of its generate()/stream()
        # call, so that calls interleaved on one LLM (open streams) each get their outputs.
        self._routes: dict[str, deque[EngineOutput]] = {}

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What a call without sampling_params samples with: SamplingParams() with the
        defaults of --generation-config (the model's generation_config.json by default)."""
        if self._defaults is None:
            from paged.engine.generation_config import generation_defaults

            src, c = self.engine.source, self.config
            path = src.path if src is not None else None
            self._defaults = generation_defaults(
                c.generation_config, path, c.override_generation_config
            )
        return SamplingParams(**self._defaults)

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
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Final outputs, in the prompts' order (whatever each request's output_kind, as vLLM's
        LLM.generate; stream() honours it). `lora_request`: the adapter of every prompt, or
        one per prompt (None: the base model); needs enable_lora=True."""
        prompts = self._normalize(prompts)
        check_sampling_params(sampling_params)
        tokenized = [self._tokenize(p) for p in prompts]
        return self._run(tokenized, sampling_params, use_tqdm, lora_request)

    @staticmethod
    def _normalize(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
        """A list of prompts, each checked (TypeError / ValueError naming prompts[i])."""
        if not isinstance(prompts, str | dict | Sequence):
            raise TypeError(f"prompts: expected a prompt or a list of them, got "
                            f"{type(prompts).__name__}")  # fmt: skip
        if isinstance(prompts, str | dict) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        check_prompts(list(prompts))
        return list(prompts)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """vLLM's offline beam search (paged.engine.beam_search): per prompt, the beam_width
        best sequences, best first (tokens hold the prompt and the output)."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params: beam_search takes BeamSearchParams, got "
                            f"{type(params).__name__}")  # fmt: skip
        prompts = self._normalize(prompts)
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
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """`continue_final_message`: leave the last (assistant) message open for the model to
        continue (with add_generation_prompt=False); `chat_template_kwargs`: template variables;
        `tools`: OpenAI-style tool definitions the template shows the model (as vLLM's, the
        output is the raw text: parse tool calls with paged.server.tool_parsers)."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message: needs add_generation_prompt=False")
        if self.tokenizer is None:
            raise ValueError("messages: this model has no tokenizer to apply a chat template")
        if not isinstance(messages, list):
            raise TypeError(f"messages: expected a list of messages (dicts) or of "
                            f"conversations, got {type(messages).__name__}")  # fmt: skip
        single = bool(messages) and isinstance(messages[0], dict)
        convs = check_conversations([messages] if single else messages, single)
        check_sampling_params(sampling_params)
        check_tools(tools)
        template_kwargs = check_mapping(chat_template_kwargs, "chat_template_kwargs")
        template = load_chat_template(chat_template) or self.chat_template
        prompts = []
        from paged.engine.chat_render import apply_chat_template  # tools the template drops

        for conv in convs:
            try:
                text = apply_chat_template(  # tools it drops in the messages (hermes format)
                    self.tokenizer,
                    conv,
                    add_generation_prompt=add_generation_prompt,
                    chat_template=template,
                    continue_final_message=continue_final_message,
                    tools=tools,
                    **template_kwargs,
                )
            except TemplateError as e:  # the template's own raise_exception(...), as the server
                raise ValueError(f"messages: cannot apply the chat template: {e}") from None
            prompts.append((text, self.tokenizer(text, add_special_tokens=False).input_ids))
        return self._run(prompts, sampling_params, use_tqdm, lora_request)

    def stream(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[RequestOutput]:
        """RequestOutputs as the engine produces them, per each request's output_kind:
        CUMULATIVE (everything so far), DELTA (the new tokens and text of the sequence that
        moved), FINAL_ONLY (once, finished). generate() returns the final outputs, as vLLM's."""
        prompts = self._normalize(prompts)
        check_sampling_params(sampling_params)
        params = self._params(sampling_params, len(prompts))
        if any(p.num_sequences > p.n for p in params):
            raise ValueError("best_of: the n best are known only at the end; use generate()")
        kinds: dict[str, RequestOutputKind] = {}
        tokenized = [self._tokenize(p) for p in prompts]
        # closed with this stream (break, .close()): its requests are aborted at once
        with contextlib.closing(self._drive(tokenized, params, False, kinds)) as outs:
            for res, st, sts, done in outs:
                kind = kinds[res.request_id]
                if done or kind != RequestOutputKind.FINAL_ONLY:
                    yield self._snapshot(res, st, sts, done, kind)

    def _snapshot(
        self, res: RequestOutput, st: OutputState, sts: list[OutputState], done: bool, kind
    ) -> RequestOutput:
        """A copy of `res` for stream(): DELTA carries only what `st` added since its last."""
        if done and kind != RequestOutputKind.DELTA:
            return res  # final: Logprob values, best_of applied
        if kind == RequestOutputKind.DELTA:
            (tokens, chars), out = st.streamed, st.out
            st.streamed = (len(out.token_ids), len(out.text))
            lps = out.logprobs[tokens:] if out.logprobs is not None else None
            if lps is not None and lps and not isinstance(next(iter(lps[0].values())), Logprob):
                lps = to_logprobs(lps, st.ranks[tokens:], out.token_ids[tokens:], self.tokenizer)
            new = {"text": out.text[chars:], "token_ids": out.token_ids[tokens:], "logprobs": lps}
            outs = [dataclasses.replace(out, **new)]
        else:
            outs = []
            for s in sts:
                o, lps = s.out, s.out.logprobs
                if lps is not None:
                    lps = to_logprobs(lps, s.ranks, o.token_ids, self.tokenizer)
                outs.append(dataclasses.replace(o, token_ids=list(o.token_ids), logprobs=lps))
        return dataclasses.replace(res, outputs=outs, finished=done)

    def _params(
        self, params: SamplingParams | Sequence[SamplingParams] | None, count: int
    ) -> list[SamplingParams]:
        if params is None:
            params = self.get_default_sampling_params()
        if isinstance(params, SamplingParams):
            params = [params] * count
        if len(params) != count:
            raise ValueError("sampling_params: one per prompt, or a single one for all")
        return list(params)

    def _run(
        self,
        prompts: list[tuple[str | None, list[int]]],
        params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        params = self._params(params, len(prompts))
        loras = lora_requests(lora_request, len(prompts))
        finals: dict[str, RequestOutput] = {}
        for res, _, _, done in self._drive(prompts, params, use_tqdm, {}, loras):
            if done:
                finals[res.request_id] = res
        return sorted(finals.values(), key=lambda r: int(r.request_id))

    def _drive(
        self,
        prompts: list[tuple[str | None, list[int]]],
        params: list[SamplingParams],
        use_tqdm: bool,
        kinds: dict[str, RequestOutputKind],
        loras: list[LoRARequest | None] | None = None,
    ) -> Iterator[tuple[RequestOutput, OutputState, list[OutputState], bool]]:
        """Run the prompts; after each engine output: its request's output, the sequence's
        state, all the request's states, and whether the request just finished (its output is
        then final). `kinds` gets each request's output_kind."""
        results: dict[str, RequestOutput] = {}
        states: dict[str, tuple[str, OutputState]] = {}
        seqs: dict[str, Request] = {}  # the engine's, for their timings
        order = []
        inbox: deque[EngineOutput] = deque()  # this call's engine outputs, in engine order
        mine: list[str] = []  # this call's sequence ids, routed to the inbox
        bar = tqdm(total=len(prompts), desc="Processed prompts", disable=not use_tqdm)
        try:
            for k, ((text, ids), p) in enumerate(zip(prompts, params)):
                rid = str(next(self._ids))
                order.append(rid)
                kinds[rid] = p.output_kind
                results[rid] = RequestOutput(rid, text, ids, [])
                p = with_best_of_logprobs(p)
                lora = loras[k] if loras else None
                cids = sequence_ids(rid, p.num_sequences)
                mine += cids  # before add_request: whatever fails next, it is aborted
                self._routes.update(dict.fromkeys(cids, inbox))
                self.engine.add_request(rid, ids, p, lora)  # n sequences, one prompt computed
                for i, cid in enumerate(cids):
                    st = OutputState(i, self.tokenizer, ids, sample_params(p, i),
                                     self.engine.eos_token_ids)  # fmt: skip
                    results[rid].outputs.append(st.out)
                    states[cid] = (rid, st)
                    seqs[cid] = self.engine.requests[cid]
            by_rid: dict[str, list[tuple[OutputState, Request]]] = {}
            for cid, (rid, st) in states.items():
                by_rid.setdefault(rid, []).append((st, seqs[cid]))
            pending = {rid: len(results[rid].outputs) for rid in order}
            left = len(order)
            while left:
                if not inbox:
                    if not self.engine.has_unfinished():
                        break
                    self._step()
                    continue
                eo = inbox.popleft()
                rid, st = states[eo.request_id]
                if eo.error:
                    raise RuntimeError(f"request {rid} failed: {eo.error}")
                if st.update(eo):
                    self.engine.abort([eo.request_id])
                res = results[rid]
                res.num_cached_tokens = eo.num_cached_tokens
                done = False
                if st.finished and not st.counted:  # its last output
                    st.counted = True
                    pending[rid] -= 1
                    done = pending[rid] == 0
                if done:
                    res.finished = True
                    self._finalize(res, by_rid[rid])
                    res.outputs = best_of(res.outputs, params[order.index(rid)])
                    bar.update(1)
                    left -= 1
                yield res, st, [s for s, _ in by_rid[rid]], done
        finally:  # done, failed or closed early: nothing of this call stays in the engine
            bar.close()
            for cid in mine:
                del self._routes[cid]
            self.engine.abort(mine)

    def _step(self) -> None:
        """One engine step; each output goes to the call that owns its request (another open
        stream() or generate() consumes it later), those of aborted requests are dropped."""
        for eo in self.engine.step():
            if (inbox := self._routes.get(eo.request_id)) is not None:
                inbox.append(eo)

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

    # ---- embeddings (docs/models.md, Embeddings) ----------------------------------------
    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """vLLM's LLM.embed: one pooled vector per prompt (`.outputs.embedding`)."""
        done = self._pool(prompts, pooling_params, truncate_prompt_tokens, use_tqdm, lora_request)
        return [
            EmbeddingRequestOutput(rid, EmbeddingOutput(vec), ids, True, cached)
            for rid, ids, vec, cached in done
        ]

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        pooling_task: str = "embed",
    ) -> list[PoolingRequestOutput]:
        """vLLM's LLM.encode for the embed task: `.outputs.data`, a float32 tensor."""
        if pooling_task != "embed":
            raise ValueError(f"pooling_task: only 'embed' is supported, got {pooling_task!r}")
        done = self._pool(prompts, pooling_params, truncate_prompt_tokens, use_tqdm, lora_request)
        return [
            PoolingRequestOutput(rid, PoolingOutput.of(vec), ids, True, cached)
            for rid, ids, vec, cached in done
        ]

    def _pool(self, prompts, pooling_params, truncate_prompt_tokens, use_tqdm, lora_request):
        prompts = self._normalize(prompts)
        params = pooling_params if pooling_params is not None else PoolingParams()
        if isinstance(params, PoolingParams):
            params = [params] * len(prompts)
        if not isinstance(params, list | tuple) or not all(
            isinstance(p, PoolingParams) for p in params
        ):
            raise TypeError(f"pooling_params: expected PoolingParams or a list of them, one per "
                            f"prompt, got {type(pooling_params).__name__}")  # fmt: skip
        if len(params) != len(prompts):
            raise ValueError("pooling_params: one per prompt, or a single one for all")
        if self._routes:  # run_pooling steps the engine alone: it would drop their outputs
            raise RuntimeError(
                "embed: another generate/stream call is in progress on this LLM "
                "(an open stream()); finish or close it first"
            )
        if truncate_prompt_tokens is not None:
            params = [dataclasses.replace(p, truncate_prompt_tokens=truncate_prompt_tokens)
                      for p in params]  # fmt: skip
        loras = lora_requests(lora_request, len(prompts))
        tokenized = [self._tokenize(p) for p in prompts]
        return run_pooling(self.engine, tokenized, list(params), self._ids, use_tqdm, list(loras))
