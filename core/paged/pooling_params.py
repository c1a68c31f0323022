"""PoolingParams: what an embedding request asks of the pooler (vLLM's fields).

A pooling request travels as the `pooling` field of its SamplingParams, so that it takes
the generation requests' path through the server, the engine's wire and the scheduler; the
engine fills `pooling_type` and `normalize` from the model's pooler configuration."""

from __future__ import annotations

from dataclasses import dataclass

POOLING_TYPES = ("LAST", "MEAN", "CLS")


@dataclass
class PoolingParams:
    # Matryoshka: keep the first `dimensions` values (only models that declare support).
    dimensions: int | None = None
    normalize: bool | None = None  # L2-normalise the vector; None: the model's default
    # Keep only the last k prompt tokens (-1: the context length); None: refuse long prompts.
    truncate_prompt_tokens: int | None = None
    pooling_type: str | None = None  # LAST | MEAN | CLS; None: the model's (filled by engine)

    def __post_init__(self) -> None:
        if self.dimensions is not None and (
            not isinstance(self.dimensions, int) or self.dimensions < 1
        ):
            raise ValueError("dimensions: must be a positive integer")
        k = self.truncate_prompt_tokens
        if k is not None and (not isinstance(k, int) or (k < 1 and k != -1)):
            raise ValueError("truncate_prompt_tokens: must be -1 or a positive integer")
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type: must be one of {', '.join(POOLING_TYPES)}")

    @property
    def needs_every_token(self) -> bool:
        """MEAN and CLS read hidden states a prefix-cache hit would skip (LAST does not)."""
        return self.pooling_type in ("MEAN", "CLS")
