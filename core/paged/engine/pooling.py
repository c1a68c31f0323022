"""Embedding requests in the engine: checks against the model's pooler, and vLLM's outputs.

An embedding request is a SamplingParams whose `pooling` is set: it runs through the same
scheduler and batches as generation, as a prefill that finishes after its last prompt chunk
(worker/pooler.py) with the pooled vector in its EngineOutput, and frees its blocks then.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from tqdm import tqdm

from paged.model.pooling_config import PoolerConfig
from paged.pooling_params import PoolingParams
from paged.sampling.params import SamplingParams


def embedding_params(pooling: PoolingParams | None = None) -> SamplingParams:
    """The SamplingParams that carry an embedding request (nothing is sampled)."""
    return SamplingParams(temperature=0.0, max_tokens=1, pooling=pooling or PoolingParams())


def prepare(
    pooler: PoolerConfig, params: SamplingParams, ids: list[int], max_model_len: int
) -> tuple[list[int], SamplingParams]:
    """The prompt (truncated where asked) and params with the model's pooling filled in;
    ValueError naming the field for what the model cannot do."""
    p = params.pooling
    if params.num_sequences != 1:
        raise ValueError("n: an embedding request has one output")
    if params.prompt_logprobs is not None or params.logprobs is not None:
        raise ValueError("logprobs: not available for embedding requests")
    k = p.truncate_prompt_tokens
    if k is not None:
        if k > max_model_len:
            raise ValueError(
                f"truncate_prompt_tokens: {k} exceeds the model's maximum context length "
                f"({max_model_len})"
            )
        ids = ids[-(max_model_len if k == -1 else k) :]
    if len(ids) > max_model_len:
        raise ValueError(
            f"input: this model's maximum context length is {max_model_len} tokens, but the "
            f"input has {len(ids)} tokens (truncate_prompt_tokens keeps the last ones)"
        )
    if p.dimensions is not None:
        if not pooler.is_matryoshka:
            raise ValueError(
                "dimensions: this model does not support Matryoshka representations (its "
                "config declares neither is_matryoshka nor matryoshka_dimensions)"
            )
        dims = pooler.matryoshka_dimensions
        if dims and p.dimensions not in dims:
            raise ValueError(
                f"dimensions: {p.dimensions} is not one of the model's Matryoshka dimensions "
                f"{list(dims)}"
            )
        if p.dimensions > pooler.hidden_size:
            raise ValueError(
                f"dimensions: {p.dimensions} exceeds the model's hidden size {pooler.hidden_size}"
            )
    normalize = pooler.normalize if p.normalize is None else p.normalize
    kind = p.pooling_type or pooler.pooling_type
    pooling = dataclasses.replace(p, normalize=normalize, pooling_type=kind)
    return ids, dataclasses.replace(params, pooling=pooling)


# ---- offline outputs in vLLM's shape ------------------------------------------------------
@dataclass
class PoolingOutput:
    data: torch.Tensor  # the pooled vector (float32)

    @classmethod
    def of(cls, vec: list[float]) -> PoolingOutput:
        return cls(torch.tensor(vec, dtype=torch.float32))


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class PoolingRequestOutput:
    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0


def run_offline(
    engine,
    prompts: list[tuple[str | None, list[int]]],
    params: list[PoolingParams],
    ids,
    use_tqdm: bool = False,
    loras: list | None = None,
) -> list[tuple[str, list[int], list[float], int]]:
    """Run embedding requests on an EngineCore to the end: per prompt, in order, (request
    id, prompt ids as computed, vector, prefix-cache hits). `ids`: an iterator of ids;
    `loras`: each prompt's LoRA adapter (or None)."""
    order, done = [], {}
    try:
        for (_, tokens), p, lora in zip(prompts, params, loras or [None] * len(prompts)):
            rid = str(next(ids))
            engine.add_request(rid, tokens, embedding_params(p), lora)
            order.append(rid)
        bar = tqdm(total=len(order), desc="Processed prompts", disable=not use_tqdm)
        while len(done) < len(order):
            for eo in engine.step():
                if eo.error:
                    raise RuntimeError(f"request {eo.request_id} failed: {eo.error}")
                if eo.finished and eo.request_id in order:
                    done[eo.request_id] = eo
                    bar.update(1)
        bar.close()
    finally:
        engine.abort(order)  # nothing left behind when a request failed or was refused
    out = []
    for rid, (_, tokens) in zip(order, prompts):
        eo = done[rid]
        kept = tokens[len(tokens) - eo.num_prompt_tokens :]  # truncation keeps the last ones
        out.append((rid, kept, eo.embedding, eo.num_cached_tokens))
    return out
