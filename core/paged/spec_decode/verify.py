"""The driver's half of a speculative step: the target's logits rows of each request that
verifies proposals (its last accepted token and each proposal: 1 + k rows) -> accepted tokens.

Requests of the step without proposals sample as in any step (bitmask, penalties and all);
the verifying ones are exact (greedy, or seeded: each row's token is the one plain decoding
draws there, and proposals are accepted while they equal it) or random (rejection sampling),
their rows processed as the sampler processes a row: logit bias, temperature, top-k, top-p,
min-p. Logprobs come from each row's raw logits (with the bias), as in plain steps.
"""

from __future__ import annotations

import torch

from paged.sampling.rejection import (
    apply_logit_bias,
    greedy_verify,
    padded_rows,
    rejection_verify,
    sampling_probs,
)
from paged.sampling.sampler import bitmask_rows, build_sampling_batch, sample
from paged.worker.model_runner import StepHandle


class _Group:
    """Requests of a step verified together, and their device results."""

    def __init__(self, idx: list[int], tokens: torch.Tensor, count: torch.Tensor, lps) -> None:
        self.idx, self.tokens, self.count, self.lps = idx, tokens, count, lps


def _logprob_tensors(raw: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor, k: int):
    """(chosen [B, K+1], rank [B, K+1], top values, top ids [B, K+1, k]) from raw rows."""
    lp = raw.log_softmax(-1)
    chosen = lp[rows, tokens]
    rank = torch.stack(  # a position at a time: no [B, K + 1, V] temporary
        [(lp[rows[:, j]] > chosen[:, j, None]).sum(-1) + 1 for j in range(rows.shape[1])], 1
    )
    out = [chosen, rank]
    if k:
        vals, ids = lp.topk(k, dim=-1)
        out += [vals[rows], ids[rows]]
    return out


def _exact(req) -> bool:
    """Whether a request's verification is exact: greedy, or seeded (its noise is keyed)."""
    return req.params.greedy or req.params.seed is not None


def _verify(
    runner, reqs: list, index: list[int], logits: torch.Tensor, drafts: list[list[int]], qs: list
) -> tuple:
    """Verify one group (all exact or all random). `index`: per request the sequence index of
    its first row's token; `logits`: the group's flat rows (changed in place by the logit
    bias); `qs`: per request the distributions its proposals were drawn from ([k, V] on the
    device) or None (point masses). Returns (tokens [B, K+1], count [B], logprob tensors or
    None)."""
    dev = logits.device
    expanded = [r for r, d in zip(reqs, drafts) for _ in range(len(d) + 1)]
    rows_index = [i + j for i, d in zip(index, drafts) for j in range(len(d) + 1)]
    sb = build_sampling_batch(expanded, dev, runner.vocab_size, rows_index)
    k = max(len(d) for d in drafts)
    draft = torch.tensor([d + [0] * (k - len(d)) for d in drafts], dtype=torch.int64)
    num_draft = torch.tensor([len(d) for d in drafts], dtype=torch.int64)
    draft, num_draft = draft.to(dev), num_draft.to(dev)
    if _exact(reqs[0]):  # the tokens plain decoding picks at each row (bias added in place)
        tokens, count = greedy_verify(sample(logits, sb), draft, num_draft)
    else:
        apply_logit_bias(logits, sb)
        q = _draft_probs(drafts, qs, k, logits.shape[1], dev)
        tokens, count = rejection_verify(sampling_probs(logits, sb), draft, num_draft, q)
    want = [r.params.logprobs for r in reqs]
    lps = None
    if any(w is not None for w in want):
        top = max(w or 0 for w in want)
        lps = _logprob_tensors(logits, padded_rows(num_draft, k), tokens, top)
    return tokens, count, lps


def _draft_probs(drafts: list[list[int]], qs: list, k: int, vocab: int, dev) -> torch.Tensor | None:
    """[B, K, V]: each request's proposal distributions, one-hot where it has none."""
    if all(q is None for q in qs):
        return None
    out = torch.zeros(len(drafts), k, vocab, device=dev)
    for b, (d, q) in enumerate(zip(drafts, qs)):
        if q is not None:
            out[b, : len(d)] = q
        else:
            out[b, torch.arange(len(d), device=dev), torch.tensor(d, device=dev)] = 1.0
    return out


def launch_verify(
    runner, batch, reqs: list, index: list[int], logits: torch.Tensor, mask
) -> StepHandle:
    """Sample the plain rows and verify the proposals of a step with `batch.spec`. `logits`:
    the sampling rows in `reqs` order (1 + k rows for a request with k proposals); `index`:
    per request the sequence index of the token its last row samples."""
    dev = logits.device
    counts = [1 + len(batch.spec.get(r.request_id, ())) for r in reqs]
    starts, at = [], 0
    for c in counts:
        starts.append(at)
        at += c
    groups: list[_Group] = []
    plain = [i for i, r in enumerate(reqs) if r.request_id not in batch.spec]
    if plain:
        sub = [reqs[i] for i in plain]
        rows = logits[torch.tensor([starts[i] for i in plain], device=dev)]
        sb = build_sampling_batch(sub, dev, runner.vocab_size, [index[i] for i in plain])
        if mask is not None:
            sb.bitmask = bitmask_rows(mask, sub, dev)
        tok = sample(rows, sb)
        want = [r.params.logprobs for r in sub]
        lps = None
        if any(w is not None for w in want):
            top = max(w or 0 for w in want)
            lps = _logprob_tensors(rows, torch.arange(len(sub), device=dev)[:, None],
                                   tok[:, None], top)  # fmt: skip
        ones = torch.ones(len(sub), dtype=torch.int64, device=dev)
        groups.append(_Group(plain, tok[:, None], ones, lps))
    for exact in (True, False):
        idx = [i for i, r in enumerate(reqs) if r.request_id in batch.spec and _exact(r) == exact]
        if not idx:
            continue
        flat = torch.tensor(
            [starts[i] + j for i in idx for j in range(counts[i])], dtype=torch.int64
        )
        drafts = [list(batch.spec[reqs[i].request_id]) for i in idx]
        sub = [reqs[i] for i in idx]
        qs = [batch.spec_probs.get(r.request_id) for r in sub]
        first_index = [index[i] - counts[i] + 1 for i in idx]
        tokens, count, lps = _verify(runner, sub, first_index, logits[flat.to(dev)], drafts, qs)
        groups.append(_Group(idx, tokens, count, lps))
    first = torch.empty(len(reqs), dtype=torch.int64, device=dev)  # read by an overlapped
    for g in groups:  # next step where a plain request's newest token is still pending
        first[torch.tensor(g.idx, device=dev)] = g.tokens[:, 0]
    return SpecStepHandle(reqs, groups, first)


class SpecStepHandle(StepHandle):
    """A verification step's results: per request the accepted proposals and one more token
    (1 + accepted in all). result() gives the first token of each, as any StepHandle;
    `extra` the rest: {request id: (tokens, logprob entries, ranks)}."""

    def __init__(self, reqs: list, groups: list[_Group], first: torch.Tensor) -> None:
        super().__init__(reqs, first, [r.params.logprobs for r in reqs], None)
        self.groups = groups
        self.extra: dict[str, tuple[list[int], list[dict[int, float]], list[int]]] = {}

    def result(self) -> tuple[list[int], dict[str, dict[int, float]]]:
        if self._result is not None:
            return self._result
        first = [0] * len(self.reqs)
        logprobs: dict[str, dict[int, float]] = {}
        for g in self.groups:
            tokens, count = g.tokens.tolist(), g.count.tolist()
            lps = [t.tolist() for t in g.lps] if g.lps is not None else None
            for b, i in enumerate(g.idx):
                req, n = self.reqs[i], count[b]
                toks = tokens[b][:n]
                w = req.params.logprobs
                entries, ranks = [], []
                if w is not None and lps is not None:
                    for j, t in enumerate(toks):
                        entry = {t: lps[0][b][j]}
                        for v, tid in zip(lps[2][b][j][:w], lps[3][b][j][:w]) if w else ():
                            entry.setdefault(tid, v)
                        entries.append(entry)
                        ranks.append(lps[1][b][j])
                    logprobs[req.request_id] = entries[0]
                    self.ranks[req.request_id] = ranks[0]
                first[i] = toks[0]
                if n > 1:
                    self.extra[req.request_id] = (toks[1:], entries[1:], ranks[1:])
        self._result = first, logprobs
        return self._result
