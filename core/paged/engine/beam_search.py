"""Beam search as vLLM runs it: each step asks the engine for one token of every live beam with
the top 2 x width logprobs, extends each beam by each candidate, and keeps the `width` best by
cumulative logprob; a candidate that ends the sequence (EOS) is set aside as completed. At the
end, live and completed beams are ranked by cumulative logprob / length ** length_penalty
(length counts the prompt, as vLLM's does, and not a final EOS).

The steps' requests share the prompt's and the beams' full KV blocks through the prefix cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from paged.engine.outputs import Logprob
from paged.sampling.params import SamplingParams

MAX_BEAM_WIDTH = 10  # 2 x width candidates per beam: the most logprobs a request may ask (20)


@dataclass
class BeamSearchParams:
    """vLLM's beam search parameters. Beams rank by the raw logprobs: `temperature` is taken for
    vLLM's signature and must stay 0."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width: must be in [1, {MAX_BEAM_WIDTH}]")
        if self.max_tokens < 1:
            raise ValueError("max_tokens: must be at least 1")
        if self.temperature != 0:
            raise ValueError("temperature: beam search ranks by logprobs; it must be 0")
        if not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty: must be a finite number, got {self.length_penalty}")


@dataclass
class BeamSearchSequence:
    """One beam: `tokens` holds the prompt and the output, as in vLLM."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]


def beam_score(seq: BeamSearchSequence, eos: tuple[int, ...], length_penalty: float) -> float:
    n = len(seq.tokens) - (1 if seq.tokens and seq.tokens[-1] in eos else 0)
    return seq.cum_logprob / (n**length_penalty)


class BeamSearch:
    """The search for one prompt, driven step by step by whoever runs the engine."""

    def __init__(
        self,
        prompt_ids: list[int],
        params: BeamSearchParams,
        eos: tuple[int, ...],
        max_model_len: int,
    ) -> None:
        self.params, self.eos, self.max_model_len = params, eos, max_model_len
        self.num_prompt = len(prompt_ids)
        self.live = [BeamSearchSequence(list(prompt_ids))]
        self.completed: list[BeamSearchSequence] = []
        self.steps = 0

    @property
    def done(self) -> bool:
        return (
            not self.live
            or self.steps >= self.params.max_tokens
            or len(self.live[0].tokens) >= self.max_model_len
        )

    def step_params(self) -> SamplingParams:
        """One greedy token with the top 2 x width logprobs of the raw distribution."""
        return SamplingParams(
            max_tokens=1, temperature=0, ignore_eos=True, logprobs=2 * self.params.beam_width
        )

    def advance(self, entries: list[dict[int, float]]) -> None:
        """`entries[i]`: {token: logprob} of live beam i's next token (its top 2 x width)."""
        candidates = []
        for beam, entry in zip(self.live, entries, strict=True):
            ranked = sorted(entry.items(), key=lambda kv: -kv[1])
            for rank, (tok, lp) in enumerate(ranked, start=1):
                new = BeamSearchSequence(
                    beam.tokens + [tok],
                    beam.logprobs + [{tok: Logprob(lp, rank)}],
                    beam.cum_logprob + lp,
                )
                if tok in self.eos and not self.params.ignore_eos:
                    new.finish_reason, new.stop_reason = "stop", None
                    self.completed.append(new)
                else:
                    candidates.append(new)
        candidates.sort(key=lambda b: -b.cum_logprob)
        self.live = candidates[: self.params.beam_width]
        self.steps += 1

    def result(self, tokenizer=None) -> BeamSearchOutput:
        """The `width` best of the live and completed beams, best first."""
        for beam in self.live:
            beam.finish_reason = "length"
        p = self.params
        ranked = sorted(
            self.completed + self.live, key=lambda b: -beam_score(b, self.eos, p.length_penalty)
        )[: p.beam_width]
        for beam in ranked:
            if tokenizer is not None:
                beam.text = tokenizer.decode(beam.tokens)
                for lps in beam.logprobs:
                    for tok, lp in lps.items():
                        lp.decoded_token = tokenizer.decode([tok])
        return BeamSearchOutput(ranked)
