"""SamplingParams: what a request asks of the sampler and of stopping."""

from __future__ import annotations

import enum
import functools
import json as _json
import math
from dataclasses import dataclass, field
from numbers import Integral, Real

from paged.pooling_params import PoolingParams

STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """Constrains the output to a JSON schema, a regex, one of some strings, an EBNF grammar
    or any JSON object (vLLM's spelling). Exactly one kind is set."""

    json: dict | str | None = None  # a JSON schema (dict or its JSON text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (GBNF / xgrammar syntax)
    json_object: bool | None = None
    disable_any_whitespace: bool = False  # json: no free whitespace between tokens

    def __post_init__(self) -> None:
        set_kinds = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError(
                "structured_outputs: exactly one of json, regex, choice, grammar, json_object "
                f"must be set (got {', '.join(set_kinds) or 'none'})"
            )
        if isinstance(self.json, str):
            try:
                _json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json: not valid JSON: {e}") from None
        elif self.json is not None and not isinstance(self.json, dict):
            raise ValueError("structured_outputs.json: must be a JSON schema object or its text")
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) for c in self.choice):
                raise ValueError("structured_outputs.choice: must be a non-empty list of strings")
            self.choice = list(self.choice)
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured_outputs.{name}: must be a non-empty string")
        if self.json_object is not None and self.json_object is not True:
            raise ValueError("structured_outputs.json_object: must be true when set")

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    @functools.cached_property
    def spec(self) -> str:
        """The kind's specification as text (the compile cache's key with the kind); computed
        once (a request's spec is read at each stage of its setup)."""
        v = getattr(self, self.kind)
        if self.kind == "json":
            return v if isinstance(v, str) else _json.dumps(v)  # key order: generation order
        if self.kind == "choice":
            return _json.dumps(v)
        return "" if self.kind == "json_object" else v


def check_structured_stop(min_tokens: int, ignore_eos: bool, what: str) -> None:
    """ValueError naming min_tokens or ignore_eos when set beside `what` (a structured output):
    its grammar ends the output once complete (it allows only the end then, as in vLLM), so
    neither a minimum length nor going on past the end could be honoured."""
    why = "the grammar ends the output once it is complete"
    if min_tokens > 0:
        raise ValueError(f"min_tokens: cannot be combined with {what} ({why}); leave it 0")
    if ignore_eos:
        raise ValueError(f"ignore_eos: cannot be combined with {what} ({why})")


class RequestOutputKind(enum.IntEnum):
    """What LLM.stream gives for a request (vLLM's): everything so far, what is new, or the
    final output only."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


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
    structured_outputs: StructuredOutputsParams | None = None
    # The structured output starts once the output ends with these token ids (a reasoning
    # model's end-of-thinking marker); None: from the first token.
    structured_outputs_after: list[int] | None = None
    # At most this many output tokens of reasoning: past it, the end marker's ids
    # (reasoning_end_ids) are forced, unless the output has ended the reasoning already.
    thinking_token_budget: int | None = None
    reasoning_end_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None  # only these ids may be sampled
    bad_words: list[str] | None = None  # these words' token sequences are never completed
    best_of: int | None = None  # sample this many, keep the n of highest cumulative logprob
    prompt_logprobs: int | None = None  # top-k logprobs of each prompt token (and its own)
    spaces_between_special_tokens: bool = True  # in the text (tokenizers that support it)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE  # LLM.stream's outputs
    # An embedding request: the prompt is pooled into a vector, nothing is sampled.
    pooling: PoolingParams | None = None
    # Filled by the engine: the model's end-of-sequence ids.
    eos_token_ids: tuple[int, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None or isinstance(self.stop, list | tuple):  # else validate() refuses
            self.stop = list(self.stop or [])
        if self.stop_token_ids is None or isinstance(self.stop_token_ids, list | tuple):
            self.stop_token_ids = list(self.stop_token_ids or [])
        if is_int(self.output_kind) and self.output_kind in set(RequestOutputKind):
            self.output_kind = RequestOutputKind(self.output_kind)
        self.validate()

    def _check_types(self) -> None:
        """TypeError naming the field for a value of the wrong type (a str number, a float
        seed, a bool token id...): the engine's step would otherwise fail on it."""

        def bad(name: str, why: str) -> None:
            v = getattr(self, name)
            raise TypeError(f"{name}: {why}, got {type(v).__name__} {v!r:.40}")

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):  # fmt: skip
            if not _is_number(getattr(self, name)):
                bad(name, "must be a number")
        for name in ("n", "top_k", "min_tokens"):
            if not is_int(getattr(self, name)):
                bad(name, "must be an integer")
        for name in ("seed", "max_tokens", "logprobs", "prompt_logprobs", "best_of",
                     "thinking_token_budget"):  # fmt: skip
            if getattr(self, name) is not None and not is_int(getattr(self, name)):
                bad(name, "must be an integer or None")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                     "spaces_between_special_tokens"):  # fmt: skip
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be a bool")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            bad("stop", "must be a string or a list of strings")
        if not isinstance(self.stop_token_ids, list) or not all(map(is_int, self.stop_token_ids)):
            bad("stop_token_ids", "must be a list of integer token ids")
        for name in ("structured_outputs_after", "reasoning_end_ids", "allowed_token_ids"):
            ids = getattr(self, name)
            if ids is not None and not (isinstance(ids, list | tuple) and all(map(is_int, ids))):
                bad(name, "must be a list of integer token ids")
        if self.bad_words is not None and not isinstance(self.bad_words, list | tuple):
            bad("bad_words", "must be a list of strings")
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, dict):
                bad("logit_bias", "must be a dict of token id (int) to bias (float)")
            for k, v in bias.items():
                if not is_int(k):
                    raise TypeError(f"logit_bias: keys must be integer token ids, got "
                                    f"{type(k).__name__} {k!r:.20}")  # fmt: skip
                if not _is_number(v) or not math.isfinite(v):
                    raise TypeError(f"logit_bias[{k}]: must be a finite number, got {v!r:.20}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind: must be a RequestOutputKind (CUMULATIVE, DELTA or "
                             f"FINAL_ONLY), got {self.output_kind!r:.40}")  # fmt: skip

    def validate(self) -> None:
        """Raise ValueError naming the field for out-of-range values."""

        def bad(name: str, why: str) -> None:
            raise ValueError(f"{name}: {why}")

        self._check_types()
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
            bad("top_k", "must be -1 or 0 (off) or positive")
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
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            bad("prompt_logprobs", "must be in [0, 20]")
        if self.best_of is not None and self.best_of < self.n:
            bad("best_of", f"must be at least n ({self.n})")
        if any(not s for s in self.stop):
            bad("stop", "stop strings must be non-empty")
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            bad("structured_outputs", "must be a StructuredOutputsParams")
        if self.structured_outputs is not None:
            check_structured_stop(self.min_tokens, self.ignore_eos, "a structured output")
        if self.structured_outputs_after is not None:
            ids = self.structured_outputs_after
            if not ids or any(t < 0 for t in ids):
                bad("structured_outputs_after", "must be a non-empty list of token ids >= 0")
            if self.structured_outputs is None:
                bad("structured_outputs_after", "needs structured_outputs")
        if self.thinking_token_budget is not None:
            ids = self.reasoning_end_ids
            if self.thinking_token_budget < 0:
                bad("thinking_token_budget", "must be >= 0")
            if not ids or any(t < 0 for t in ids):
                bad("reasoning_end_ids", "a reasoning budget needs the end marker's token ids")
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not ids or any(t < 0 for t in ids):
                bad("allowed_token_ids", "must be a non-empty list of token ids >= 0")
        if self.bad_words is not None and any(
            not isinstance(w, str) or not w for w in self.bad_words
        ):
            bad("bad_words", "must be a list of non-empty strings")

    @property
    def num_sequences(self) -> int:
        """Sequences the engine runs for this request: best_of, else n."""
        return self.best_of or self.n

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


def is_int(v: object) -> bool:
    """An integer (a token id, a count), not a bool."""
    return isinstance(v, Integral) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, Real) and not isinstance(v, bool)
