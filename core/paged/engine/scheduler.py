"""Continuous batching at iteration level.

Each step: running decodes first, then running prefill chunks, then waiting requests,
all within the token budget (`max_num_batched_tokens`) and `max_num_seqs`. When blocks run
out, the newest running request is preempted (its blocks freed, recomputed later).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from paged.engine.kv_cache import KVCacheManager
from paged.engine.request import Request, Status


@dataclass
class Batch:
    """One step's work, decodes first: request i computes num_new[i] more tokens."""

    reqs: list[Request] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)
    num_decodes: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new)

    def __len__(self) -> int:
        return len(self.reqs)


class Scheduler:
    def __init__(
        self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch:
        budget = self.max_num_batched_tokens
        batch, preempted = Batch(), False
        # Running requests: decodes first (stable sort keeps admission order within each).
        for req in sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1):
            if budget <= 0:
                break
            if req.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate(req, req.num_computed_tokens + n):
                victim = next((r for r in reversed(self.running) if r not in batch.reqs), req)
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                batch.reqs.append(req)
                batch.num_new.append(n)
                budget -= n
        batch.num_decodes = sum(
            1
            for n, r in zip(batch.num_new, batch.reqs)
            if n == 1 and r.num_computed_tokens + 1 == r.num_tokens
        )
        # Waiting requests, unless this step already had to preempt.
        while (
            self.waiting and budget > 0 and not preempted and len(self.running) < self.max_num_seqs
        ):
            req = self.waiting[0]
            cached = self.kv.find_cached(req) if req.num_computed_tokens == 0 else []
            start = len(cached) * self.kv.block_size
            n = min(req.num_tokens - start, budget)
            if not self.kv.allocate(req, start + n, cached):
                break
            self.waiting.popleft()
            if req.num_cached_tokens < 0:  # first admission: count prefix-cache hits
                req.num_cached_tokens = start
                self.kv.queries += req.num_tokens
                self.kv.hits += start
            req.num_computed_tokens = start
            req.status = Status.RUNNING
            self.running.append(req)
            batch.reqs.append(req)
            batch.num_new.append(n)
            budget -= n
        return batch

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free_request(req)
        req.num_computed_tokens = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def update(self, batch: Batch, sampled: list[int]) -> list[Request]:
        """Advance the batch by its computed tokens and sampled ids (one per request that
        finished its prompt: partial prefill chunks sample nothing). Returns the requests
        that got a token or finished."""
        changed, it = [], iter(sampled)
        for req, n in zip(batch.reqs, batch.num_new):
            if req.finished:  # aborted while the step ran: its blocks are already freed
                if req.num_computed_tokens + n >= req.num_tokens:
                    next(it)
                continue
            req.num_computed_tokens += n
            self.kv.cache_full_blocks(req)
            if req.num_computed_tokens < req.num_tokens:
                continue  # a prefill chunk: nothing sampled yet
            tok = next(it)
            req.token_ids.append(tok)
            self._check_stop(req, tok)
            if req.finished:
                self._finish(req)
            changed.append(req)
        return changed

    def _check_stop(self, req: Request, tok: int) -> None:
        p = req.params
        if req.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and tok in p.eos_token_ids:
                req.status, req.finish_reason = Status.FINISHED, "stop"
                return
            if tok in p.stop_token_ids:
                req.status, req.finish_reason, req.stop_reason = Status.FINISHED, "stop", tok
                return
        if (
            p.max_tokens is not None
            and req.num_output_tokens >= p.max_tokens
            or req.num_tokens >= self.max_model_len
        ):
            req.status, req.finish_reason = Status.FINISHED, "length"

    def _finish(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self.kv.free_request(req)

    def finish(self, req: Request, reason: str, stop_reason: int | str | None = None) -> None:
        """End a request from outside (abort, stop string, error) and free its blocks."""
        if req.finished:
            return
        req.status, req.finish_reason, req.stop_reason = Status.FINISHED, reason, stop_reason
        self._finish(req)
