"""A request as the engine core sees it: token ids, progress, blocks, status."""

from __future__ import annotations

import dataclasses
import enum
import time

from paged.lora.request import LoRARequest
from paged.sampling.params import SamplingParams


def sequence_ids(request_id: str, num: int) -> list[str]:
    """The ids of a request's sequences: its own with one, ``{id}-{i}`` with several."""
    return [request_id] if num == 1 else [f"{request_id}-{i}" for i in range(num)]


def sample_params(p: SamplingParams, i: int) -> SamplingParams:
    """Sequence i of a request of n > 1 samples: n = 1, seed + i (as n seeded requests)."""
    if p.num_sequences == 1:
        return p
    return dataclasses.replace(p, n=1, best_of=None, seed=None if p.seed is None else p.seed + i)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.request_id = request_id
        self.params = params
        self.lora_request = lora_request  # the adapter it runs with (None: the base model)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.token_ids: list[int] = list(prompt_token_ids)  # prompt + output, grows
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache (or being written)
        self.num_pending = 0  # trailing PLACEHOLDERs: tokens sampled by steps still in flight
        self.num_cached_tokens = -1  # prompt tokens served by the prefix cache (first schedule)
        # Its blocks in each KV-cache group (one list unless the model mixes windows).
        self.group_block_ids: list[list[int]] = [[]]
        # Changes when KVCacheManager changes blocks already listed (not when it appends):
        # the worker's input buffers keep block tables between steps (BlockRows).
        self.block_version = 0
        self.status = Status.WAITING
        self.finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
        self.stop_reason: int | str | None = None
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.num_preemptions = 0
        # n > 1: the first sequence computes the prompt; the others wait in its `followers`
        # (their `leader`) and are forked from it, sharing its blocks, when its prompt is done.
        self.followers: list[Request] = []
        self.leader: Request | None = None
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        # prompt_logprobs of prompt tokens 1.. as computed so far, and whether they were sent
        self.prompt_logprobs: list[dict[int, float]] = []
        self.prompt_ranks: list[int] = []
        self.prompt_logprobs_sent = False

    def add_prompt_logprobs(self, first: int, entries: list[dict[int, float]], ranks: list[int]):
        """Logprobs of prompt tokens `first`.. (a chunk computed again after a preemption
        repeats some: those are dropped)."""
        skip = len(self.prompt_logprobs) + 1 - first
        if skip >= 0:
            self.prompt_logprobs += entries[skip:]
            self.prompt_ranks += ranks[skip:]

    @property
    def block_ids(self) -> list[int]:
        """Its blocks in the first KV-cache group (the only one unless layers mix windows)."""
        return self.group_block_ids[0]

    @block_ids.setter
    def block_ids(self, ids: list[int]) -> None:
        self.group_block_ids[0] = ids

    @property
    def lora_int_id(self) -> int:
        """Its adapter's id, 0 for the base model."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def hash_seed(self) -> tuple[str, int] | None:
        """What its first block's prefix-cache hash starts from: blocks computed with an
        adapter are never shared with the base model or another adapter."""
        return None if self.lora_request is None else ("lora", self.lora_request.lora_int_id)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, status={self.status.value})"
        )
