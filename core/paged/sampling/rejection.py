"""Verification of speculative proposals against the target model's distributions.

Each request b has num_draft[b] <= K proposals; its target rows are j = 0..num_draft[b]
(row j: the distribution of the token after proposal j). Output: the accepted proposals and
one more token (the first mismatch's replacement, or the bonus token after all of them),
padded to K + 1, and how many of them are real (accepted + 1).

Greedy: accept while the target's argmax equals the proposal; the argmax at the first mismatch
(or after the last proposal) follows. Exact: the tokens plain greedy decoding would produce.

Seeded requests verify as greedy ones do, against the token plain seeded sampling draws at
each row (their noise is keyed by output position; their proposals were drawn with the same
noise): the output is the plain decoding's, and distributed as p.

Random (unseeded): proposal x at row j is accepted with probability min(1, p(x) / q(x)); at
the first rejection the token is drawn from norm(max(0, p - q)); after all acceptances from p.
With q a point mass (n-gram proposals, greedy drafts) that is: accept with p(x), else draw from p
without x. The output is distributed as p at every position (Leviathan et al., 2023).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from paged.sampling.sampler import _top_k_top_p, exponential_race

if TYPE_CHECKING:
    from paged.sampling.sampler import SamplingBatch


def sampling_probs(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """The normalised distribution `sample` draws from, per row (rows that sample randomly,
    their logit bias already added): temperature, top-k, top-p, min-p."""
    scaled = logits / sb.temperature[:, None]
    if sb.top_k is not None or sb.top_p is not None:
        scaled = _top_k_top_p(scaled, sb.top_k, sb.top_p)
    probs = scaled.softmax(dim=-1)
    if sb.min_p is not None:
        top = probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < sb.min_p[:, None] * top, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def apply_logit_bias(logits: torch.Tensor, sb: SamplingBatch) -> None:
    """Add each row's logit bias in place (as `sample` does)."""
    for i, bias in sb.logit_bias:
        ids = torch.tensor(list(bias.keys()), device=logits.device)
        vals = torch.tensor(list(bias.values()), device=logits.device, dtype=logits.dtype)
        logits[i].index_add_(0, ids, vals)


def padded_rows(num_draft: torch.Tensor, k: int) -> torch.Tensor:
    """[B, K + 1] row index into the flat target rows (request b's rows are consecutive,
    num_draft[b] + 1 of them); positions past a request's last row repeat its last."""
    counts = num_draft + 1
    starts = torch.cumsum(counts, 0) - counts
    j = torch.arange(k + 1, device=num_draft.device)[None, :]
    return starts[:, None] + torch.minimum(j, num_draft[:, None])


def greedy_verify(
    argmax: torch.Tensor, draft: torch.Tensor, num_draft: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`argmax` [R] the target's argmax per flat row, `draft` [B, K] (padded), `num_draft` [B].
    Returns (tokens [B, K + 1], count [B])."""
    b, k = draft.shape
    target = argmax[padded_rows(num_draft, k)]  # [B, K + 1]
    valid = torch.arange(k, device=draft.device)[None, :] < num_draft[:, None]
    ok = (target[:, :k] == draft) & valid
    accepted = torch.cumprod(ok.to(torch.int64), dim=1).sum(1)  # [B]
    tokens = torch.cat([draft, draft[:, :1]], dim=1).clone()
    tokens.scatter_(1, accepted[:, None], target.gather(1, accepted[:, None]))
    return tokens, accepted + 1


def rejection_verify(
    probs: torch.Tensor,
    draft: torch.Tensor,
    num_draft: torch.Tensor,
    draft_probs: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`probs` [R, V] the target's normalised sampling distribution per flat row, `draft`
    [B, K] (padded), `num_draft` [B], `draft_probs` [B, K, V] the proposals' distributions
    (None: point masses at `draft`); draws from torch's default generator. Returns (tokens
    [B, K + 1], count [B])."""
    b, k = draft.shape
    dev = probs.device
    rows = padded_rows(num_draft, k)  # [B, K + 1]
    p_x = probs[rows[:, :k], draft]  # target probability of each proposal [B, K]
    q_x = (
        torch.ones_like(p_x)
        if draft_probs is None
        else draft_probs.gather(2, draft[..., None]).squeeze(2)
    )
    uniform = torch.empty(b, k, device=dev, dtype=probs.dtype).uniform_()
    valid = torch.arange(k, device=dev)[None, :] < num_draft[:, None]
    ok = (uniform * q_x < p_x) & valid  # u < p / q
    accepted = torch.cumprod(ok.to(torch.int64), dim=1).sum(1)  # [B]
    p = probs[rows.gather(1, accepted[:, None]).squeeze(1)]  # [B, V] at the stop position
    rejected = accepted < num_draft
    if draft_probs is None:
        q = torch.zeros_like(p)
        x = draft.gather(1, accepted.clamp(max=k - 1)[:, None])
        q.scatter_(1, x, 1.0)
    else:
        q = draft_probs[torch.arange(b, device=dev), accepted.clamp(max=k - 1)]
    q = q * rejected[:, None]  # after all proposals were accepted: p itself
    resid = (p - q).clamp_min(0)
    resid = torch.where(resid.sum(1, keepdim=True) > 0, resid, p)  # p == q: never rejected
    last = exponential_race(resid, {})  # a draw from norm(resid)
    tokens = torch.cat([draft, draft[:, :1]], dim=1).clone()
    tokens.scatter_(1, accepted[:, None], last[:, None])
    return tokens, accepted + 1
