"""Results in vLLM's shape, and the per-request state that assembles them."""

from __future__ import annotations

from dataclasses import dataclass, field

from paged.engine.core import EngineOutput
from paged.engine.detokenizer import IncrementalDetokenizer, StopChecker
from paged.sampling.params import SamplingParams


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None
    logprobs: list | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)


class OutputState:
    """Detokenizes one sequence, applies stop strings; says when the engine must abort it."""

    def __init__(self, index: int, tokenizer, prompt_ids: list[int], params: SamplingParams):
        self.out = CompletionOutput(index, "", [])
        self.detok = (
            IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens)
            if tokenizer is not None
            else None
        )
        self.stops = StopChecker(params.stop, params.include_stop_str_in_output)
        self.emitted = 0  # characters already streamed
        self.finished = False

    def update(self, eo: EngineOutput) -> bool:
        """Apply an engine output; True when a stop string ended the sequence here."""
        out = self.out
        out.token_ids.extend(eo.new_token_ids)
        if eo.logprobs:
            out.logprobs = (out.logprobs or []) + eo.logprobs
            out.cumulative_logprob = (out.cumulative_logprob or 0.0) + sum(
                lp[t] for lp, t in zip(eo.logprobs, eo.new_token_ids)
            )
        stopped = False
        if self.detok is not None and not self.finished:
            delta = self.detok.add(eo.new_token_ids)
            out.text += delta
            if delta:
                out.text, hit = self.stops.check(out.text, len(delta))
                if hit is not None:
                    out.finish_reason, out.stop_reason, stopped = "stop", hit, True
        if eo.finished and not stopped:
            out.finish_reason, out.stop_reason = eo.finish_reason, eo.stop_reason
        self.finished = self.finished or eo.finished or stopped
        return stopped

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
