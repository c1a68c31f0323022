"""--speculative-config: vLLM's spelling, parsed and checked once (a JSON string or a dict)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# Methods of heads from a checkpoint other than EAGLE-1's and EAGLE-3's: not implemented.
_HEADS = ("mtp", "medusa", "mlp_speculator", "deepseek_mtp")
_METHODS = ("ngram", "draft_model", "eagle", "eagle3")
EAGLE_METHODS = ("eagle", "eagle3")
_KEYS = {
    "method",
    "model",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "draft_tensor_parallel_size",
    "revision",
    "quantization",
}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # "ngram" | "draft_model" | "eagle" | "eagle3"
    num_speculative_tokens: int  # K: proposals verified per step and request
    prompt_lookup_max: int = 4  # ngram: longest suffix looked up in the earlier tokens
    prompt_lookup_min: int = 1  # ngram: shortest
    model: str | None = None  # draft_model, eagle(3): the draft's or head's directory or Hub id
    revision: str | None = None  # draft_model, eagle(3): Hub revision

    @classmethod
    def parse(cls, value: Any) -> SpeculativeConfig | None:
        """A SpeculativeConfig from a JSON string or dict (None, "" or {}: off). Raises
        ValueError naming the key at fault."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            if not value.strip():
                return None
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"speculative_config: not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("speculative_config: must be a JSON object")
        if not value:
            return None
        unknown = sorted(set(value) - _KEYS)
        if unknown:
            raise ValueError(
                f"speculative_config: unknown key(s) {', '.join(unknown)} "
                f"(known: {', '.join(sorted(_KEYS))})"
            )
        method = value.get("method")
        if method is None:
            method = "draft_model" if value.get("model") else None
        if method in _HEADS:
            raise ValueError(
                f"speculative_config.method: {method!r} (draft heads from a checkpoint) is not "
                "supported yet; use 'eagle' / 'eagle3' (EAGLE-1 / EAGLE-3 heads), 'ngram' or a "
                "draft model ('draft_model' with 'model')"
            )
        if method not in _METHODS:
            raise ValueError(
                f"speculative_config.method: must be one of {', '.join(_METHODS)}, got {method!r}"
            )
        if value.get("draft_tensor_parallel_size", 1) != 1:
            raise ValueError("speculative_config.draft_tensor_parallel_size: only 1 is supported")
        if value.get("quantization") is not None:
            raise ValueError("speculative_config.quantization: not supported")
        k = value.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 32:
            raise ValueError("speculative_config.num_speculative_tokens: an integer in [1, 32]")
        lo, hi = value.get("prompt_lookup_min", 1), value.get("prompt_lookup_max", 4)
        model = value.get("model")
        if method == "ngram":
            for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                    raise ValueError(f"speculative_config.{name}: a positive integer")
            if lo > hi:
                raise ValueError("speculative_config.prompt_lookup_min: must not exceed max")
            if model is not None:
                raise ValueError("speculative_config.model: not used by method 'ngram'")
        elif not isinstance(model, str) or not model:
            what = "EAGLE head's" if method in EAGLE_METHODS else "draft model's"
            raise ValueError(f"speculative_config.model: the {what} path or Hub id")
        if method in EAGLE_METHODS:
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                if name in value:
                    raise ValueError(f"speculative_config.{name}: not used by method {method!r}")
        return cls(method, k, hi, lo, model, value.get("revision"))
