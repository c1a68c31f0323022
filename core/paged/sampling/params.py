"""SamplingParams: what a request asks of the sampler and of stopping."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    # Filled by the engine: the model's end-of-sequence ids.
    eos_token_ids: tuple[int, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the field for out-of-range values."""

        def bad(name: str, why: str) -> None:
            raise ValueError(f"{name}: {why}")

        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        ):
            if not math.isfinite(float(getattr(self, name))):
                bad(name, "must be a finite number")
        if self.n < 1:
            bad("n", "must be at least 1")
        if self.temperature < 0:
            bad("temperature", "must be >= 0")
        if not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if self.top_k < -1:
            bad("top_k", "must be -1 (off) or positive")
        if not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", "must be > 0")
        if not -2 <= self.presence_penalty <= 2:
            bad("presence_penalty", "must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            bad("frequency_penalty", "must be in [-2, 2]")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad("max_tokens", "must be at least 1")
        if self.min_tokens < 0:
            bad("min_tokens", "must be >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", "must not exceed max_tokens")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            bad("logprobs", "must be in [0, 20]")
        if any(not s for s in self.stop):
            bad("stop", "stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )
