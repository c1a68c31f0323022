"""Continuous batching at iteration level.

Each step: running decodes first, then running prefill chunks, then waiting requests,
all within the token budget (`max_num_batched_tokens`) and `max_num_seqs`. When blocks run
out, the newest running request is preempted (its blocks freed, recomputed later).

A request of n > 1 sequences is scheduled as its first sequence (the leader); the step that
completes its prompt forks the others from it: they share its blocks and sample their first
token from its logits, so the prompt is computed and stored once.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from paged.engine.kv_cache import KVCacheManager
from paged.engine.request import Request, Status
from paged.scheduled import PLACEHOLDER, ScheduledBatch


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        max_loras: int = 0,
    ) -> None:
        """`max_loras`: most distinct LoRA adapters in one step (the device slots; 0: LoRA
        off, no limit)."""
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.max_loras = max_loras
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.reset_counters()
        self.finished_ids: list[str] = []  # ended since the last schedule(): workers forget them
        # Speculative decoding: most proposals a decoding request may verify (0: none); its
        # lookahead slots are allocated with the step and given back after it.
        self.lookahead: Callable[[Request], int] | None = None

    def reset_counters(self) -> None:
        self.num_preemptions = 0
        self.num_prompt_computed = 0  # prompt tokens through the forward (prefix hits excluded)

    def add(self, req: Request, followers: list[Request] = ()) -> None:
        """Queue `req`; `followers`: the other sequences of its prompt, forked from it. A group
        larger than max_num_seqs is split into groups that fit, each computing the prompt."""
        group = [req, *followers]
        for k in range(0, len(group), self.max_num_seqs):
            leader, *rest = group[k : k + self.max_num_seqs]
            leader.followers = rest
            for f in rest:
                f.leader = leader
            self.waiting.append(leader)

    def _seats(self) -> int:
        """Sequences running, with the followers of running leaders (forked later)."""
        return len(self.running) + sum(len(r.followers) for r in self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        batch, preempted = ScheduledBatch(finished_ids=self.finished_ids), False
        if self.lookahead is not None:  # every decode keeps a token of the budget
            running = self.running
            self._decodes_left = sum(r.num_computed_tokens + 1 == r.num_tokens for r in running)
        self.finished_ids = []
        loras: set[int] = set()  # adapters in this step (at most max_loras)
        # Running requests: decodes first (stable sort keeps admission order within each).
        for req in sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1):
            if budget <= 0:
                break
            if req.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            if req.num_pending and self._length_reached(req, req.num_tokens):
                continue  # its last token is still being sampled: it ends when that lands
            if req.num_computed_tokens >= req.num_tokens:
                continue  # an embedding request whose last chunk is in flight
            if not self._lora_fits(req, loras):
                continue  # its adapter waits for a step with a free slot
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            k = self._lookahead(req, n, budget)
            while not self.kv.allocate(req, req.num_computed_tokens + n + k):
                victim = next((r for r in reversed(self.running) if r not in batch.reqs), req)
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                batch.reqs.append(req)
                batch.num_new.append(n)
                budget -= n + k
                if k:
                    batch.lookahead[req.request_id] = k
        batch.num_decodes = sum(
            1
            for n, r in zip(batch.num_new, batch.reqs)
            if n == 1 and r.num_computed_tokens + 1 == r.num_tokens
        )
        # Waiting requests, unless this step already had to preempt.
        seats = self._seats()
        # LoRA: the running requests use at most max_loras adapters (so every step fits in
        # the slots and no running request waits for one). A waiting request whose adapter
        # would exceed that waits, and so do the LoRA requests behind it (first come, first
        # served: a busy adapter cannot starve another); base-model requests go ahead.
        active = {r.lora_int_id for r in self.running} - {0} if self.max_loras else set()
        skipped: list[Request] = []  # waiting requests whose adapter has no slot yet
        skipped_lora = False
        while self.waiting and budget > 0 and not preempted:
            req = self.waiting[0]
            lid = req.lora_int_id
            no_slot = lid not in active and len(active) >= self.max_loras
            if lid and self.max_loras and (skipped_lora or no_slot):
                skipped.append(self.waiting.popleft())
                skipped_lora = True
                continue
            if seats + 1 + len(req.followers) > self.max_num_seqs:
                break
            hit = self.kv.find_hit(req) if req.num_computed_tokens == 0 else None
            start = len(hit[0]) * self.kv.block_size if hit else 0
            n = min(req.num_tokens - start, budget)
            if not self.kv.allocate(req, start + n, hit):  # counts every KV-cache group's
                break
            self.waiting.popleft()
            if req.num_cached_tokens < 0:  # first admission: count prefix-cache hits
                req.num_cached_tokens = start
                self.kv.queries += req.num_tokens
                self.kv.hits += start
            req.num_computed_tokens = start
            req.status = Status.RUNNING
            req.first_scheduled_time = req.first_scheduled_time or time.time()
            self.running.append(req)
            if lid:
                active.add(lid)
            seats += 1 + len(req.followers)
            batch.reqs.append(req)
            batch.num_new.append(n)
            budget -= n
        self.waiting.extendleft(reversed(skipped))
        for req, n in zip(batch.reqs, batch.num_new):
            prompt_left = req.num_prompt_tokens - req.num_computed_tokens
            self.num_prompt_computed += max(0, min(n, prompt_left))
            if req.followers and req.num_computed_tokens + n == req.num_tokens:
                batch.forks.append((req, req.followers))
        batch.block_copies = self.kv.take_copies()
        return batch

    def _lora_fits(self, req: Request, loras: set[int]) -> bool:
        """Whether `req`'s adapter can be in this step (added to `loras` if so)."""
        lid = req.lora_int_id
        if not lid or not self.max_loras:
            return True
        if lid not in loras and len(loras) >= self.max_loras:
            return False
        loras.add(lid)
        return True

    def _lookahead(self, req: Request, n: int, budget: int) -> int:
        """Proposals a decode may verify in this step: within the token budget, the context
        length and max_tokens (every accepted token and the one after count as output)."""
        if self.lookahead is None or n != 1 or req.num_pending:
            return 0
        if req.num_computed_tokens + 1 != req.num_tokens:
            return 0
        self._decodes_left -= 1  # the decodes after this one keep one token each
        k = min(self.lookahead(req), budget - 1 - self._decodes_left)
        k = min(k, self.max_model_len - req.num_tokens - 1)
        if req.params.max_tokens is not None:
            k = min(k, req.params.max_tokens - req.num_output_tokens - 1)
        return max(k, 0)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free_request(req)
        req.num_computed_tokens = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def launched(self, batch: ScheduledBatch) -> list[int]:
        """The step is on the device: advance each request by the tokens it computes. A request
        that completes its prompt or decodes gets a PLACEHOLDER for the token being sampled.
        Returns each request's computed count."""
        computed = []
        for req, n in zip(batch.reqs, batch.num_new):
            # A verifying request computes its last token for sure; the proposals once accepted.
            req.num_computed_tokens += n - len(batch.spec.get(req.request_id, ()))
            computed.append(req.num_computed_tokens)
            if req.num_computed_tokens == req.num_tokens and req.params.pooling is None:
                req.token_ids.append(PLACEHOLDER)
                req.num_pending += 1
        for leader, followers in batch.forks:
            for f in followers:  # the prompt is in the leader's blocks: share them
                self.kv.fork(leader, f)
                f.leader = None
                f.num_computed_tokens = f.num_prompt_tokens
                f.num_cached_tokens = leader.num_cached_tokens
                f.token_ids.append(PLACEHOLDER)
                f.num_pending = 1
                f.status = Status.RUNNING
                f.first_scheduled_time = leader.first_scheduled_time
                self.running.append(f)
            leader.followers = []
        return computed

    def resolve(
        self,
        batch: ScheduledBatch,
        computed: list[int],
        sampling: list[Request],
        sampled: list[int],
        extra: dict[str, list[int]] | None = None,
    ) -> list[tuple[Request, list[int]]]:
        """A launched step's tokens have landed: each replaces its request's oldest placeholder
        and is checked for a stop. `sampling`: the requests that sampled, in row order (the
        launch's StepHandle.reqs). `extra`: tokens after the first of verifying requests (the
        accepted proposals after the first, and the token after them), appended one by one up
        to a stop. Returns (request, its new tokens) for those still alive."""
        for req, upto in zip(batch.reqs, computed):  # K/V of the step's full blocks: cacheable
            if not req.finished and req.num_computed_tokens >= upto:
                self.kv.cache_full_blocks(req, upto)
        got = []
        for req, tok in zip(sampling, sampled):
            if req.finished:  # aborted or stopped while the step ran: its blocks are freed
                continue
            idx = req.num_tokens - req.num_pending
            req.token_ids[idx] = tok
            req.num_pending -= 1
            if req.first_token_time is None:
                req.first_token_time = time.time()
            self._check_stop(req, tok, idx + 1)
            toks = [tok]
            for t in (extra or {}).get(req.request_id, ()):
                if req.finished:
                    break
                req.token_ids.append(t)  # the previous token (a proposal) was computed
                req.num_computed_tokens += 1
                toks.append(t)
                self._check_stop(req, t, req.num_tokens)
            if req.finished:
                self._finish(req)
            elif req.request_id in batch.lookahead:  # lookahead blocks not needed: back
                self.kv.trim(req, req.num_tokens)
            got.append((req, toks))
        return got

    def _check_stop(self, req: Request, tok: int, length: int) -> None:
        """`tok` is the request's token number `length` (prompt included)."""
        p = req.params
        if length - req.num_prompt_tokens >= p.min_tokens:
            if not p.ignore_eos and tok in p.eos_token_ids:
                req.status, req.finish_reason = Status.FINISHED, "stop"
                return
            if tok in p.stop_token_ids:
                req.status, req.finish_reason, req.stop_reason = Status.FINISHED, "stop", tok
                return
        if self._length_reached(req, length):
            req.status, req.finish_reason = Status.FINISHED, "length"

    def _length_reached(self, req: Request, length: int) -> bool:
        max_tokens = req.params.max_tokens
        return (
            max_tokens is not None and length - req.num_prompt_tokens >= max_tokens
        ) or length >= self.max_model_len

    def _finish(self, req: Request) -> None:
        self.finished_ids.append(req.request_id)
        req.finished_time = time.time()
        if req.leader is not None:  # a sequence not forked yet
            req.leader.followers.remove(req)
            req.leader = None
        if req.followers:  # ends before its prompt was computed: the next one leads
            nxt, *rest = req.followers
            req.followers, nxt.leader, nxt.followers = [], None, rest
            for f in rest:
                f.leader = nxt
            self.waiting.appendleft(nxt)
        if req.num_pending:  # tokens of steps still in flight: no longer wanted
            del req.token_ids[req.num_tokens - req.num_pending :]
            req.num_pending = 0
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
