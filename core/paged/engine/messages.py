"""The engine <-> server protocol: typed messages, encoded with msgpack (msgspec).

Two tagged unions, one per direction of the two ZMQ sockets (see async_engine.py):
    server -> core   Add | Abort | Shutdown
    core -> server   Ready | Error | Outputs | Alive
Each message is a msgspec Struct encoded as a msgpack array whose first element is its tag.
Every process keeps one Encoder and one Decoder per socket direction (`encoder()`,
`to_engine_decoder()`, `from_engine_decoder()`).

`EngineOutput`, one step's result for one sequence, lives here (and is re-exported by
paged.engine.core) so that this module stays below both the engine and the server: it
imports nothing of paged but SamplingParams.
"""

from __future__ import annotations

import msgspec

from paged.lora.request import LoRARequest
from paged.sampling.params import SamplingParams

_WIRE = dict(array_like=True, gc=False)  # compact arrays; no reference cycles to collect
# finish_reason of a request the core refused as the client's error (the server answers 400):
# at admission, or a constraint no token of the vocabulary can continue
REJECTED = "rejected"


class EngineOutput(msgspec.Struct, **_WIRE):
    """What one engine step produced for one sequence."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    logprobs: list[dict[int, float]] | None = None  # one {token: logprob} per new token
    ranks: list[int] | None = None  # with logprobs: each new token's rank (1: the most likely)
    # prompt_logprobs, with the first token: {token: logprob} (the prompt's token and the top-k)
    # and the prompt token's rank, for prompt tokens 1.. (token 0 has none)
    prompt_logprobs: list[dict[int, float]] | None = None
    prompt_ranks: list[int] | None = None
    embedding: list[float] | None = None  # a pooling request's vector (with finished)


class EngineInfo(msgspec.Struct, **_WIRE):
    """What a core reports once it is ready (AsyncEngine.info holds it as a dict)."""

    max_model_len: int
    vocab_size: int
    model_name: str | None
    num_blocks: int
    block_size: int
    pid: int
    platform: str
    dtype: str
    eos_token_ids: list[int] = []  # the model's end-of-sequence ids (beam search sets aside)


# ---- server -> core ----------------------------------------------------------------------
class NewRequest(msgspec.Struct, **_WIRE):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # a dataclass: msgspec encodes its fields and validates on decode
    lora: LoRARequest | None = None  # the LoRA adapter it runs with (None: the base model)


class Add(msgspec.Struct, tag="add", **_WIRE):
    requests: list[NewRequest]


class Abort(msgspec.Struct, tag="abort", **_WIRE):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown", **_WIRE):
    pass


class UnloadLora(msgspec.Struct, tag="lora_unload", **_WIRE):
    """A LoRA adapter was unloaded: the core frees its slot and host copy."""

    lora_int_id: int


ToEngine = Add | Abort | Shutdown | UnloadLora


# ---- core -> server ----------------------------------------------------------------------
class Ready(msgspec.Struct, tag="ready", **_WIRE):
    info: EngineInfo


class Error(msgspec.Struct, tag="error", **_WIRE):
    """The core could not start (the message says why); it exits non-zero."""

    message: str


class Outputs(msgspec.Struct, tag="out", **_WIRE):
    """One engine step's outputs (or the rejections and aborts of an idle loop), the core's
    metrics after it (EngineCore.metrics()) and the queue times of the requests it first
    scheduled ({request id: seconds from arrival})."""

    outputs: list[EngineOutput]
    stats: dict[str, float]
    queue_times: dict[str, float]


class Alive(msgspec.Struct, tag="alive", **_WIRE):
    """The heartbeat: the core process runs (sent every HEARTBEAT_S, also when idle)."""


FromEngine = Ready | Error | Outputs | Alive


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def to_engine_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(ToEngine)


def from_engine_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(FromEngine)
