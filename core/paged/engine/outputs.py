"""Results in vLLM's shape, and the per-request state that assembles them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import msgspec

from paged.engine.core import EngineOutput
from paged.engine.detokenizer import IncrementalDetokenizer, StopChecker
from paged.sampling.params import SamplingParams


@dataclass
class Logprob:
    """vLLM's shape of one token's logprob: value, rank in the distribution (1: the most
    likely), and the token's text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class RequestMetrics:
    """vLLM's request timings (time.time() seconds)."""

    arrival_time: float
    last_token_time: float | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    time_in_queue: float | None = None
    finished_time: float | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None
    logprobs: list | None = None  # per token {token id: logprob} (offline: Logprob values)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


class OutputState:
    """Detokenizes one sequence, applies stop strings; says when the engine must abort it.

    As vLLM: stop strings end nothing before `min_tokens` tokens, and the token that ended the
    sequence (an EOS of `eos_token_ids`, or one of the request's stop_token_ids) stays in
    token_ids but not in the text unless include_stop_str_in_output."""

    def __init__(
        self,
        index: int,
        tokenizer,
        prompt_ids: list[int],
        params: SamplingParams,
        eos_token_ids: tuple[int, ...] | list[int] = (),
    ):
        self.out = CompletionOutput(index, "", [])
        self.detok = (
            IncrementalDetokenizer(
                tokenizer,
                prompt_ids,
                params.skip_special_tokens,
                params.spaces_between_special_tokens,
            )
            if tokenizer is not None
            else None
        )
        self.stops = StopChecker(params.stop, params.include_stop_str_in_output)
        self.min_tokens = params.min_tokens
        # tokens whose text a sequence they end leaves out
        self.stop_ids = set() if params.include_stop_str_in_output else {
            *params.stop_token_ids, *(() if params.ignore_eos else eos_token_ids)}  # fmt: skip
        self.emitted = 0  # characters already streamed
        self.finished = False
        self.ranks: list[int] = []  # with logprobs: each token's rank
        self.counted = False  # LLM: its finish was counted
        self.streamed = (0, 0)  # LLM.stream DELTA: tokens and characters already given
        self.prompt_logprobs: list[dict[int, float]] | None = None  # of prompt tokens 1..
        self.prompt_ranks: list[int] = []
        self.kept = 0  # tokens of the last update's output kept (a stop string may cut them)

    def update(self, eo: EngineOutput) -> bool:
        """Apply an engine output; True when a stop string ended the sequence here."""
        if len(eo.new_token_ids) > 1 and self.stops.stop and self.detok is not None:
            return self._update_each(eo)  # several tokens (speculative decoding)
        out = self.out
        out.token_ids.extend(eo.new_token_ids)
        self.kept = len(eo.new_token_ids)
        if eo.prompt_logprobs is not None:
            self.prompt_logprobs, self.prompt_ranks = eo.prompt_logprobs, eo.prompt_ranks or []
        if eo.logprobs:
            self.ranks += eo.ranks or []
            out.logprobs = (out.logprobs or []) + eo.logprobs
            out.cumulative_logprob = (out.cumulative_logprob or 0.0) + sum(
                lp[t] for lp, t in zip(eo.logprobs, eo.new_token_ids)
            )
        stopped = False
        if self.detok is not None and not self.finished:
            ids = eo.new_token_ids
            if eo.finished and eo.finish_reason == "stop" and ids and ids[-1] in self.stop_ids:
                ids = ids[:-1]  # the stop token's own text
            delta = self.detok.add(ids)
            out.text += delta
            if delta and len(out.token_ids) > self.min_tokens:
                out.text, hit = self.stops.check(out.text, len(delta))
                if hit is not None:
                    out.finish_reason, out.stop_reason, stopped = "stop", hit, True
        if eo.finished and not stopped:
            out.finish_reason, out.stop_reason = eo.finish_reason, eo.stop_reason
        self.finished = self.finished or eo.finished or stopped
        return stopped

    def _update_each(self, eo: EngineOutput) -> bool:
        """Apply several new tokens one at a time, so that a stop string ends the output (its
        tokens too) at the token that completes it, as without speculative decoding."""
        n = len(eo.new_token_ids)
        for j, tok in enumerate(eo.new_token_ids):
            last = j == n - 1
            one = msgspec.structs.replace(
                eo,
                new_token_ids=[tok],
                finished=eo.finished and last,
                finish_reason=eo.finish_reason if last else None,
                stop_reason=eo.stop_reason if last else None,
                logprobs=eo.logprobs[j : j + 1] if eo.logprobs else eo.logprobs,
                ranks=eo.ranks[j : j + 1] if eo.ranks else eo.ranks,
                prompt_logprobs=eo.prompt_logprobs if j == 0 else None,
                prompt_ranks=eo.prompt_ranks if j == 0 else None,
            )
            if self.update(one):
                self.kept = j + 1
                return True
        self.kept = n
        return False

    def text_delta(self) -> str:
        """New text safe to stream: holds back a possible partial stop string."""
        end = (
            len(self.out.text)
            if self.finished
            else max(self.emitted, len(self.out.text) - self.stops.hold)
        )
        delta = self.out.text[self.emitted : end]
        self.emitted = end
        return delta


def to_logprobs(
    entries: list[dict[int, float]], ranks: list[int], tokens: list[int], tokenizer
) -> list[dict[int, Logprob]]:
    """{token: Logprob} per position from the engine's {token: logprob} entries: the position's
    own token (rank from the engine) and the top-k (ranked by value)."""
    out = []
    for entry, rank, tok in zip(entries, ranks, tokens):
        order = sorted(entry, key=lambda t: -entry[t])
        lps = {}
        for t in [tok, *order]:
            if t in lps:
                continue
            text = tokenizer.decode([t]) if tokenizer is not None else None
            r = rank if t == tok else order.index(t) + 1
            lps[t] = Logprob(entry[t], r, text)
        out.append(lps)
    return out


def with_best_of_logprobs(p: SamplingParams) -> SamplingParams:
    """best_of ranks sequences by cumulative logprob: compute the sampled tokens' logprobs."""
    if p.num_sequences > p.n and p.logprobs is None:
        return dataclasses.replace(p, logprobs=0)
    return p


def best_of(outputs: list[CompletionOutput], p: SamplingParams) -> list[CompletionOutput]:
    """The n outputs of highest cumulative logprob (all of them without best_of), indexed 0..n-1;
    logprobs dropped when only best_of asked for them."""
    if p.num_sequences == p.n:
        return outputs
    ranked = sorted(outputs, key=lambda o: -(o.cumulative_logprob or 0.0))[: p.n]
    for i, o in enumerate(ranked):
        o.index = i
        if p.logprobs is None:
            o.logprobs = None
    return ranked
