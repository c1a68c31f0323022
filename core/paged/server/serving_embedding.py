"""POST /v1/embeddings: OpenAI's request and response, with vLLM's extra fields.

Each input is one embedding request through the engine's scheduler (engine/pooling.py); the
vectors come back as floats or as base64 of little-endian float32 (OpenAI's encoding)."""

from __future__ import annotations

import base64
import time
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import Field, StrictInt

from paged.engine.pooling import embedding_params
from paged.pooling_params import PoolingParams
from paged.server.errors import APIError, bad_request
from paged.server.lora_adapters import CURRENT as CURRENT_LORA
from paged.server.protocol import RequestBody, TruncatePromptTokens
from paged.server.serving import CURRENT_USER, Prompt, Serving, api_error, new_id, truncation

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request
TokenId = Annotated[StrictInt, Field(ge=0)]


class EmbeddingRequest(RequestBody):
    # A string, strings, token ids or lists of token ids (OpenAI); each is one embedding.
    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)  # Matryoshka models only
    user: str | None = Field(None, max_length=256)  # named in the request log and trace
    truncate_prompt_tokens: TruncatePromptTokens | None = None  # vLLM: the last k (-1: all fit)
    normalize: bool | None = None  # vLLM: None is the model's default
    add_special_tokens: bool = True  # vLLM: for string inputs


async def create_embedding(sv: Serving, req: EmbeddingRequest) -> dict[str, Any]:
    sv.check_model(req.model, req.user)  # the model, or a LoRA adapter the vectors use
    raw: list = [req.input] if isinstance(req.input, str) else list(req.input)
    if raw and isinstance(raw[0], int):
        raw = [raw]  # one prompt of token ids
    if not raw:
        raise APIError(400, "input: must not be empty", "input")
    if len(raw) > MAX_INPUTS:
        raise APIError(400, f"input: at most {MAX_INPUTS} inputs per request", "input")
    try:
        pooling = PoolingParams(req.dimensions, req.normalize, req.truncate_prompt_tokens)
    except ValueError as e:
        raise bad_request(e) from None
    params = embedding_params(pooling)
    prompts = [await _prompt(sv, item, params, req.add_special_tokens) for item in raw]
    rid = new_id("embd")
    vectors: dict[int, list[float]] = {}
    counts = [0] * len(prompts)
    try:
        async for k, u in sv.generate(rid, prompts):
            if u.output.embedding is not None:
                vectors[k], counts[k] = u.output.embedding, u.output.num_prompt_tokens
    except Exception as e:
        raise api_error(e) from None
    if len(vectors) != len(prompts):  # every request ends with its vector or an error
        raise APIError(500, "the engine ended an embedding request without its vector")
    data = [
        {"object": "embedding", "index": k, "embedding": _encode(vectors[k], req.encoding_format)}
        for k in range(len(prompts))
    ]
    n = sum(counts)
    return {
        "id": rid,
        "object": "list",
        "created": int(time.time()),
        "model": sv.model_name,
        "data": data,
        "usage": {"prompt_tokens": n, "total_tokens": n},
    }


async def _prompt(sv: Serving, item: str | list[int], params, special: bool) -> Prompt:
    """One input as token ids, checked (too long: 400 unless truncate_prompt_tokens)."""
    if isinstance(item, str):
        if not item:
            raise APIError(400, "input: must not be empty", "input")
        ids = await sv.tokenize(item, "input", special)
    else:
        ids = list(item)
        if not ids:
            raise APIError(400, "input: must not be empty", "input")
    sv.check_ids(ids, "input")
    limit, keep = sv.max_model_len, truncation(sv, params.pooling.truncate_prompt_tokens)
    if keep is None and len(ids) > limit:
        msg = (
            f"input: this model's maximum context length is {limit} tokens, but an input has "
            f"{len(ids)} tokens (truncate_prompt_tokens keeps the last ones)"
        )
        raise APIError(400, msg, "input", "context_length_exceeded")
    text = item if isinstance(item, str) else None
    return Prompt(text, ids, params, CURRENT_LORA.get(), CURRENT_USER.get())


def _encode(vec: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vec, dtype="<f4").tobytes()).decode("ascii")
    return vec
