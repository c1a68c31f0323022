"""paged: an LLM inference and serving engine with a paged KV cache and platform plugins."""

from __future__ import annotations

from typing import TYPE_CHECKING

from paged.hookspecs import hookimpl
from paged.sampling.params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "BeamSearchParams", "SamplingParams", "hookimpl", "__version__"]

if TYPE_CHECKING:
    from paged.engine.beam_search import BeamSearchParams
    from paged.engine.llm import LLM


def __getattr__(name: str):
    if name == "LLM":
        from paged.engine.llm import LLM

        return LLM
    if name == "BeamSearchParams":
        from paged.engine.beam_search import BeamSearchParams

        return BeamSearchParams
    raise AttributeError(name)
