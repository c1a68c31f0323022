"""Batched sampling on the device: penalties, temperature, top-k, top-p, min-p, seeds.

Random draws use the exponential race (argmax of p / Exp(1)). A seeded request's noise for
its i-th output token comes from (seed, i) alone, so it gets the same tokens whatever
else is in the batch, however its steps were scheduled (chunks, preemption, overlap) and with
or without speculation: a speculative step's proposals and verification draw the same noise.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from paged.model import ops
from paged.scheduled import RequestView

if TYPE_CHECKING:
    from paged.scheduled import TokenBitmask


@dataclass
class SamplingBatch:
    temperature: torch.Tensor | None  # [N] float32; 0 marks greedy rows
    top_k: torch.Tensor | None  # [N] int64, vocab size where off
    top_p: torch.Tensor | None  # [N] float32
    min_p: torch.Tensor | None  # [N] float32
    all_greedy: bool
    seeded: dict[int, int]  # row -> noise key of a seeded row (noise_key(seed, index))
    penalties: tuple[torch.Tensor, ...] | None  # repetition, presence, frequency [N]
    reqs: list[RequestView]
    min_tokens_mask: list[tuple[int, list[int]]]  # (row, token ids to forbid)
    logit_bias: list[tuple[int, dict[int, float]]]
    # (rows [k] int64 or None for all, packed int32 bitmask [k, ceil(V/32)], bit set:
    # allowed) on the device:
    # structured outputs, allowed_token_ids and bad_words of the masked rows.
    bitmask: tuple[torch.Tensor | None, torch.Tensor] | None = None

    @property
    def argmax_only(self) -> bool:
        """Whether sample() reduces to the logits' argmax: every row greedy, nothing that
        changes the logits first."""
        return (
            self.all_greedy
            and self.penalties is None
            and not self.logit_bias
            and not self.min_tokens_mask
            and self.bitmask is None
        )


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def noise_key(seed: int, index: int) -> int:
    """The generator seed of a seeded request's draw for its output token `index`."""
    return _splitmix64((_splitmix64(seed & _MASK64) + index) & _MASK64)


_local = threading.local()  # a generator per device and thread, reseeded at every draw


def _seeded_exponential(out: torch.Tensor, key: int) -> None:
    """Fill `out` with Exp(1) noise that depends on `key` alone."""
    gens = _local.__dict__.setdefault("gens", {})
    gen = gens.get(out.device)
    if gen is None:
        gen = gens[out.device] = torch.Generator(device=out.device)
    out.exponential_(generator=gen.manual_seed(key))


def exponential_race(probs: torch.Tensor, seeded: dict[int, int]) -> torch.Tensor:
    """A draw from each row of `probs` [N, V] (normalised or not): argmax of p / Exp(1),
    torch's default generator's noise except for the seeded rows' keyed noise (row -> key)."""
    noise = torch.empty_like(probs).exponential_()
    for row, key in seeded.items():
        _seeded_exponential(noise[row], key)
    return (probs / noise).argmax(dim=-1)


def build_sampling_batch(
    reqs: list[RequestView], device: torch.device, vocab_size: int, indices: Sequence[int]
) -> SamplingBatch:
    """`indices`: per row, the sequence index of the token it samples (a seeded row's noise
    is keyed by its place in the output)."""
    ps = [r.params for r in reqs]
    greedy = [p.greedy for p in ps]
    simple = all(greedy) and not any(
        p.needs_penalties or p.logit_bias or r.num_output_tokens < p.min_tokens
        for r, p in zip(reqs, ps)
    )
    if simple:  # the common greedy case: no tensors to build or copy
        return SamplingBatch(None, None, None, None, True, {}, None, reqs, [], [])
    temp = torch.tensor(
        [0.0 if g else p.temperature for g, p in zip(greedy, ps)], dtype=torch.float32
    )
    any_k = any(p.top_k > 0 for p in ps)
    any_p = any(p.top_p < 1.0 for p in ps)
    any_min_p = any(p.min_p > 0 for p in ps)
    any_pen = any(p.needs_penalties for p in ps)
    seeded = {  # keyed by the token's place in the output (the prompt's length aside)
        i: noise_key(r.params.seed, index - r.num_prompt_tokens)
        for i, (r, g, index) in enumerate(zip(reqs, greedy, indices))
        if not g and r.params.seed is not None
    }
    min_tok = []
    for i, r in enumerate(reqs):
        p = r.params
        if r.num_output_tokens < p.min_tokens:
            forbid = list(p.stop_token_ids) + ([] if p.ignore_eos else list(p.eos_token_ids))
            if forbid:
                min_tok.append((i, forbid))

    def dev(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    return SamplingBatch(
        temperature=temp.to(device, non_blocking=True),
        top_k=dev([p.top_k if p.top_k > 0 else vocab_size for p in ps], torch.int64)
        if any_k
        else None,
        top_p=dev([p.top_p for p in ps], torch.float32) if any_p else None,
        min_p=dev([p.min_p for p in ps], torch.float32) if any_min_p else None,
        all_greedy=all(greedy),
        seeded=seeded,
        penalties=(
            dev([p.repetition_penalty for p in ps], torch.float32),
            dev([p.presence_penalty for p in ps], torch.float32),
            dev([p.frequency_penalty for p in ps], torch.float32),
        )
        if any_pen
        else None,
        reqs=reqs,
        min_tokens_mask=min_tok,
        logit_bias=[(i, r.params.logit_bias) for i, r in enumerate(reqs) if r.params.logit_bias],
    )


def bitmask_rows(
    mask: TokenBitmask, reqs: list[RequestView], device: torch.device, pin: bool = False
) -> tuple[torch.Tensor | None, torch.Tensor] | None:
    """The step's bitmask (rows by request id) on the device, rows as in `reqs` (the
    requests that sample, in logits row order). `pin`: copy from page-locked memory, so the
    copy is queued behind the forward instead of waiting for it (a copy from pageable memory
    first waits for the stream)."""
    row_of, bm = mask
    pairs = [(i, row_of[r.request_id]) for i, r in enumerate(reqs) if r.request_id in row_of]
    if not pairs:
        return None
    rows = [i for i, _ in pairs]
    src = [j for _, j in pairs]
    if src != list(range(bm.shape[0])):
        bm = bm[torch.tensor(src)]
    if pin and not bm.is_pinned():
        bm = bm.pin_memory()
    everyone = rows == list(range(len(reqs)))
    rows_t = None
    if not everyone:
        rows_t = torch.tensor(rows, dtype=torch.int64, pin_memory=pin).to(device, non_blocking=True)
    return rows_t, bm.to(device, non_blocking=True)


def _apply_penalties(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    rep, pres, freq = sb.penalties
    n, vocab = logits.shape
    out_counts = torch.zeros(n, vocab, dtype=torch.float32)
    seen_prompt = torch.zeros(n, vocab, dtype=torch.bool)
    for i, r in enumerate(sb.reqs):
        if not r.params.needs_penalties:  # unchanged by them (its newest token may be in
            continue  # flight: steps without penalty rows overlap, PLACEHOLDER)
        out = r.output_token_ids
        if out:
            out_counts[i].index_add_(0, torch.tensor(out), torch.ones(len(out)))
        seen_prompt[i, torch.tensor(r.prompt_token_ids)] = True
    out_counts = out_counts.to(logits.device)
    seen = seen_prompt.to(logits.device) | (out_counts > 0)
    # Repetition penalty (CTRL / HF): divide positive logits, multiply negative ones.
    r = rep[:, None].expand_as(logits)
    logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
    # OpenAI presence/frequency penalties count generated tokens only.
    logits = logits - freq[:, None] * out_counts - pres[:, None] * (out_counts > 0)
    return logits


def sample(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """logits [N, V] float32 -> token ids [N] (int64, on the logits' device). The token
    bitmask is applied to `logits` in place (so logprobs taken after see it, as in vLLM)."""
    if sb.bitmask is not None:
        ops.get("apply_token_bitmask")(logits, sb.bitmask[1], sb.bitmask[0])
    if sb.logit_bias:
        for i, bias in sb.logit_bias:
            ids = torch.tensor(list(bias.keys()), device=logits.device)
            vals = torch.tensor(list(bias.values()), device=logits.device, dtype=logits.dtype)
            logits[i].index_add_(0, ids, vals)
    for i, forbid in sb.min_tokens_mask:  # unless nothing else is left (a finished grammar)
        banned = logits[i].index_fill(0, torch.tensor(forbid, device=logits.device), -math.inf)
        logits[i] = torch.where(banned.max() > -math.inf, banned, logits[i])
    if sb.penalties is not None:
        logits = _apply_penalties(logits, sb)
    greedy_ids = logits.argmax(dim=-1)
    if sb.all_greedy:
        return greedy_ids
    return _draw(logits, greedy_ids, sb.temperature, sb.top_k, sb.top_p, sb.min_p, sb.seeded)


def plain_rows(reqs: list[RequestView], vocab_size: int) -> list[tuple] | None:
    """Each row's (temperature, top_k, top_p, min_p), a greedy row at temperature 0, when
    nothing else shapes the step's draw: no seed, penalty, logit bias or min_tokens still to
    reach (a bitmask is the caller's to rule out); else None. What `sample_rows` takes."""
    rows = []
    for r in reqs:
        p = r.params
        if p.needs_penalties or p.logit_bias or r.num_output_tokens < p.min_tokens:
            return None
        if p.greedy:
            rows.append((0.0, vocab_size, 1.0, 0.0))
        elif p.seed is not None:  # its keyed noise
            return None
        else:
            rows.append((p.temperature, p.top_k if p.top_k > 0 else vocab_size, p.top_p, p.min_p))
    return rows


def sample_rows(
    logits: torch.Tensor, greedy_ids: torch.Tensor, params: torch.Tensor, sort: bool
) -> torch.Tensor:
    """`sample`'s draw for rows `plain_rows` describes, with no decision on the host (a
    captured graph replays it): params [4, N] float32 holds their temperature, top_k, top_p
    and min_p; `greedy_ids` is logits.argmax(-1). `sort`: some row uses top-k or top-p.
    Where `sample` skips a filter no row uses, this applies it as a no-op (top-k at the
    vocabulary size, top-p at 1, min-p at 0): the same tokens from the same random state."""
    top_k, top_p = (params[1].long(), params[2]) if sort else (None, None)
    return _draw(logits, greedy_ids, params[0], top_k, top_p, params[3], {})


def _draw(
    logits: torch.Tensor,
    greedy_ids: torch.Tensor,
    temp: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    seeded: dict[int, int],
) -> torch.Tensor:
    """The random draw (rows at temperature 0 keep greedy_ids): the exponential race over the
    filtered distribution, seeded rows with their keyed noise."""
    scaled = logits / torch.where(temp > 0, temp, 1.0)[:, None]
    if top_k is not None or top_p is not None:
        scaled = _top_k_top_p(scaled, top_k, top_p)
    probs = scaled.softmax(dim=-1)
    if min_p is not None:
        top = probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < min_p[:, None] * top, 0.0)
    return torch.where(temp > 0, exponential_race(probs, seeded), greedy_ids)


def _top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    sorted_logits, idx = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    if top_k is not None:
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        sorted_logits = sorted_logits.masked_fill(ranks >= top_k[:, None], float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the mass strictly before it already reaches top_p (< 1: a sum
        # rounded up to 1 drops nothing).
        before = probs.cumsum(dim=-1) - probs
        drop = (before >= top_p[:, None]) & (top_p[:, None] < 1.0)
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, idx, sorted_logits)
