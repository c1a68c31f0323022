"""What one step asks of the workers, in types that sit below both the engine and the worker:
the scheduled batch and a read-only view of each request in it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from paged.sampling.params import SamplingParams

if TYPE_CHECKING:
    import torch

# A step's token mask: ({request id: row}, packed int32 bitmask [rows, ceil(V/32)] on the
# host, bit set: allowed), for the requests that sample under a mask (structured outputs).
TokenBitmask = tuple[dict[str, int], "torch.Tensor"]

# Stands in token_ids for a token still being sampled on the device (overlapped steps).
PLACEHOLDER = -1


class RequestView(Protocol):
    """What a worker reads of a request (the engine's Request is one)."""

    request_id: str
    params: SamplingParams
    token_ids: list[int]  # prompt + output; trailing PLACEHOLDERs for tokens being sampled
    num_prompt_tokens: int
    num_computed_tokens: int  # tokens whose K/V are in the cache (before this step)
    num_pending: int  # trailing PLACEHOLDERs
    block_ids: list[int]  # in the first KV-cache group
    group_block_ids: list[list[int]]  # in every group (read where a model has several)

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_output_tokens(self) -> int: ...

    @property
    def output_token_ids(self) -> list[int]: ...


@dataclass
class ScheduledBatch:
    """One step's work, decodes first: request i computes num_new[i] more tokens."""

    reqs: list[RequestView] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)
    num_decodes: int = 0
    # Requests that ended since the last step: workers drop what they keep for them.
    finished_ids: list[str] = field(default_factory=list)
    # KV blocks to copy (source, destination) before the forward: copy-on-write of a partial
    # block that several sequences share (n > 1 samples forked from one prompt).
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # (request, sequences): requests that complete their prompt in this step and the other
    # samples forked from them (sharing its blocks); each samples from the request's logits row.
    forks: list[tuple[RequestView, list[RequestView]]] = field(default_factory=list)
    # The token mask of the requests that sample under one (None: no request does), or a
    # function that fills it: the driver calls it once the forward is queued, so that the
    # host fills the mask while the device computes.
    token_bitmask: TokenBitmask | Callable[[], TokenBitmask | None] | None = None
    # Speculative decoding: {request id: most proposals} for the decodes given lookahead
    # slots (the scheduler), and {request id: proposals} for those that verify some (the
    # engine; such a request computes 1 + len(proposals) tokens: its last and the proposals).
    lookahead: dict[str, int] = field(default_factory=dict)
    spec: dict[str, list[int]] = field(default_factory=dict)
    # {request id: [k, V] device tensor}: the distributions sampled proposals were drawn from
    # (a draft model's, on the driver); requests not in it proposed point masses.
    spec_probs: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new)

    def __len__(self) -> int:
        return len(self.reqs)
