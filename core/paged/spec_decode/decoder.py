"""The engine core's side of speculative decoding: which decodes may verify proposals, the
proposals themselves (n-gram lookup on the host, a draft model or an EAGLE head on the
driver), and the acceptance counters for /metrics.

A step goes: the scheduler gives each eligible decode up to K lookahead slots (blocks and
token budget); `propose` asks the proposer for that many tokens and turns the decode into a
verification of 1 + k tokens (its last token and the proposals); the driver verifies them
(spec_decode/verify.py) and the scheduler appends the accepted tokens and the one after,
stopping where a stop condition hits; the lookahead blocks past the new length are given back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from paged.sampling.structured import StructuredOutputs
from paged.spec_decode.config import SpeculativeConfig
from paged.spec_decode.ngram import ngram_propose

if TYPE_CHECKING:
    from paged.engine.request import Request
    from paged.scheduled import ScheduledBatch


def can_speculate(req: Request) -> bool:
    """Whether the sampler's view of the request's verified rows is exact without the host
    seeing each token first: penalties, masks (structured outputs, allowed ids, bad words) and
    an unmet min_tokens depend on the tokens before each row, so such requests decode plainly."""
    p = req.params
    return not (
        p.needs_penalties
        or StructuredOutputs.needs(p)
        or req.num_output_tokens < p.min_tokens
        or getattr(p, "pooling", None) is not None
    )


class SpecDecoder:
    def __init__(self, spec: SpeculativeConfig, draft_runner=None, target_runner=None) -> None:
        """`draft_runner`: the driver's draft model or EAGLE head; `target_runner`: the
        driver's (EAGLE reads its hidden states)."""
        self.spec = spec
        self.k = spec.num_speculative_tokens
        self.draft = None  # a proposer with a runner of its own (spec_decode/drafting.py)
        if spec.method == "draft_model":
            from paged.spec_decode.draft import DraftProposer

            self.draft = DraftProposer(draft_runner)
        elif spec.method in ("eagle", "eagle3"):
            from paged.spec_decode.eagle import EagleProposer

            self.draft = EagleProposer(draft_runner, target_runner)
        self.reset_counters()

    def reset_counters(self) -> None:
        self.num_drafts = 0  # verifications (a request's proposals in one step)
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * self.k  # proposals accepted at position i

    def lookahead(self, req: Request) -> int:
        """Scheduler hook: the most proposals `req` may verify this step."""
        return self.k if can_speculate(req) else 0

    def propose(self, batch: ScheduledBatch) -> None:
        """Fill `batch.spec` for the decodes given lookahead slots and grow their num_new.
        Verifying requests move after the plain decodes (the batch stays decodes first)."""
        if self.draft is not None:
            self.draft.forget(batch.finished_ids)
        items = []
        if not batch.forks:  # a fork reads its leader's single row
            items = [(r, batch.lookahead[r.request_id]) for r in batch.reqs
                     if r.request_id in batch.lookahead]  # fmt: skip
        if self.draft is not None:  # EAGLE's head also catches up on the other requests
            props = self.draft.propose(batch, items)
        elif items:
            lo, hi = self.spec.prompt_lookup_min, self.spec.prompt_lookup_max
            props = {r.request_id: ngram_propose(r.token_ids, k, lo, hi) for r, k in items}
        else:
            return
        batch.spec = {rid: p for rid, p in props.items() if p}
        if self.draft is not None:  # sampled proposals: the draft's distributions (q)
            batch.spec_probs = {
                rid: torch.stack(qs) for rid, qs in self.draft.probs.items() if rid in batch.spec
            }
        if not batch.spec:
            return
        for i, r in enumerate(batch.reqs):
            batch.num_new[i] += len(batch.spec.get(r.request_id, ()))
        order = sorted(range(len(batch.reqs)), key=lambda i: _rank(batch, i))
        batch.reqs = [batch.reqs[i] for i in order]
        batch.num_new = [batch.num_new[i] for i in order]
        batch.num_decodes = sum(
            1
            for n, r in zip(batch.num_new, batch.reqs)
            if n == 1 and r.num_computed_tokens + 1 == r.num_tokens
        )

    def record(self, batch: ScheduledBatch, accepted: dict[str, int]) -> None:
        """Count a resolved step's verifications: {request id: proposals accepted}."""
        for rid, props in batch.spec.items():
            a = accepted.get(rid, 0)
            self.num_drafts += 1
            self.num_draft_tokens += len(props)
            self.num_accepted_tokens += a
            for i in range(a):
                self.accepted_per_pos[i] += 1

    def metrics(self) -> dict[str, float]:
        out = {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
        }
        for i, n in enumerate(self.accepted_per_pos):
            out[f"spec_decode_num_accepted_tokens_per_pos_{i}"] = n
        return out


def _rank(batch: ScheduledBatch, i: int) -> int:
    """Plain decodes, then verifying requests, then prompt chunks (stable within each)."""
    r = batch.reqs[i]
    if r.request_id in batch.spec:
        return 1
    decode = batch.num_new[i] == 1 and r.num_computed_tokens + 1 == r.num_tokens
    return 0 if decode else 2
