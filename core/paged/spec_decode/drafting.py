"""What the draft model and the EAGLE head share: proposals from a second model runner on the
driver, with its own paged KV cache of as many blocks as the target's, addressed by the
target's block tables (the scheduler's allocations, lookahead slots included), so it needs no
allocator of its own.

Per step the proposer first computes what it has not seen (catch-up, in chunks within the
token budget), then decodes one token at a time: each request's newest proposal in, the next
out, k proposals in all. For a greedy request the proposer's argmax (a point mass for the
verification); for a sampling request a draw from the proposer's distribution under the
request's own temperature / top-k / top-p / min-p / logit bias, kept as q for the rejection
sampler (a proposer like the target is then mostly accepted). A seeded request's draw uses
the noise the target's draw at that position will use, so the two agree where the
distributions are alike. Its KV at a rejected proposal's position is overwritten when the
sequence gets there, as the target's.
"""

from __future__ import annotations

import torch

from paged.sampling.params import SamplingParams
from paged.sampling.rejection import apply_logit_bias, sampling_probs
from paged.sampling.sampler import build_sampling_batch, exponential_race
from paged.scheduled import ScheduledBatch


class DraftView:
    """A request as the proposer's runner sees it (a RequestView): the token ids it computes
    and how many proposals it wants (0: catch up only)."""

    params = SamplingParams(temperature=0)
    num_pending = 0
    lora_int_id = 0

    def __init__(
        self, request_id: str, token_ids: list[int], done: int, block_ids: list[int], want: int
    ) -> None:
        self.request_id = request_id
        self.token_ids = token_ids
        self.num_prompt_tokens = len(token_ids)
        self.num_computed_tokens = done
        self.block_ids = block_ids
        self.want = want

    num_tokens = property(lambda self: len(self.token_ids))
    # the sequence index of the token its last row proposes (the EAGLE head's views are
    # shifted by one)
    next_index = property(lambda self: len(self.token_ids))
    num_output_tokens = property(lambda self: 0)
    output_token_ids = property(lambda self: [])
    group_block_ids = property(lambda self: [self.block_ids])


class RunnerProposer:
    """Subclasses say which views a step computes (`views`) and how a forward runs
    (`forward`); `ended` sees the hidden rows that end a view's input."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.reqs: dict[str, object] = {}  # the requests of the current propose()
        # the last propose()'s distributions of sampled proposals: {request id: [k, V]}
        self.probs: dict[str, list[torch.Tensor]] = {}

    def forget(self, request_ids: list[str]) -> None:
        """Drop what is kept for requests that ended."""

    def views(self, batch: ScheduledBatch, items: list) -> list[DraftView]:
        raise NotImplementedError

    def forward(self, batch: ScheduledBatch) -> torch.Tensor | None:
        """The proposer's final hidden states at the rows that end a view's tokens."""
        raise NotImplementedError

    def ended(self, views: list[DraftView], hidden: torch.Tensor) -> None:
        """After a forward: `hidden` [len(views), H], the rows ending each view's tokens."""

    @torch.inference_mode()
    def propose(self, batch: ScheduledBatch, items: list) -> dict[str, list[int]]:
        """{request id: proposals} for (request, k) pairs (decodes with lookahead slots)."""
        self.reqs = {req.request_id: req for req, _ in items}
        self.probs = {}
        views = self.views(batch, items)
        props: dict[str, list[int]] = {v.request_id: [] for v in views}
        budget_max = self.runner.config.max_num_batched_tokens
        todo = [v for v in views if v.num_computed_tokens < v.num_tokens]
        while todo:  # catch up: what the proposer has not seen, within the token budget
            step, budget = ScheduledBatch(), budget_max
            for v in todo:
                n = min(v.num_tokens - v.num_computed_tokens, budget)
                if n <= 0:
                    break
                step.reqs.append(v)
                step.num_new.append(n)
                budget -= n
            self._run(step, props)
            todo = [v for v in todo if v.num_computed_tokens < v.num_tokens]
        # Then one token at a time: each request's newest proposal in, the next out.
        for _ in range(max((v.want for v in views), default=0) - 1):
            step = ScheduledBatch()
            for v in views:
                mine = props[v.request_id]
                if mine and len(mine) < v.want:
                    v.token_ids.append(mine[-1])
                    step.reqs.append(v)
                    step.num_new.append(1)
            if not step.reqs:
                break
            step.num_decodes = len(step.reqs)
            self._run(step, props)
        return {rid: p for rid, p in props.items() if p}

    def _run(self, batch: ScheduledBatch, props: dict[str, list[int]]) -> None:
        """One forward; the next proposal of each view whose input ends its tokens."""
        hidden = self.forward(batch)
        ends = [v for v, n in zip(batch.reqs, batch.num_new)
                if v.num_computed_tokens + n >= v.num_tokens]  # fmt: skip
        for v, n in zip(batch.reqs, batch.num_new):
            v.num_computed_tokens += n
        if hidden is None or not ends:
            return
        self.ended(ends, hidden)
        keep = [i for i, v in enumerate(ends) if len(props[v.request_id]) < v.want]
        if not keep:
            return
        if len(keep) < len(ends):
            hidden = hidden[torch.tensor(keep, device=hidden.device)]
            ends = [ends[i] for i in keep]
        tokens = self._pick(ends, self.runner.model.compute_logits(hidden))
        for v, t in zip(ends, tokens):
            props[v.request_id].append(t)

    def _pick(self, views: list[DraftView], logits: torch.Tensor) -> list[int]:
        """Each view's proposal from its logits row: the argmax for a greedy request, else a
        draw from the request's own distribution (kept in self.probs as q)."""
        r = self.runner
        tokens = logits.argmax(-1)
        sampled = [i for i, v in enumerate(views) if not self.reqs[v.request_id].params.greedy]
        if sampled:
            reqs = [self.reqs[views[i].request_id] for i in sampled]
            at = torch.tensor(sampled, device=logits.device)
            rows = logits[at]
            index = [views[i].next_index for i in sampled]
            sb = build_sampling_batch(reqs, logits.device, r.vocab_size, index)
            apply_logit_bias(rows, sb)
            q = sampling_probs(rows, sb)
            tokens[at] = exponential_race(q, sb.seeded)
            for j, i in enumerate(sampled):
                self.probs.setdefault(views[i].request_id, []).append(q[j])
        return tokens.tolist()
