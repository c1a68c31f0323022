"""Pipeline parallelism: a step's batch goes through the stages as micro-batches.

The step's requests are split into contiguous groups of about equal tokens. Stage 0 runs
group k through its layers, sends the activations on (without waiting) and starts group k+1
while stage 1 runs group k, and so on (GPipe within one step). With m groups and p stages a
step takes about (m + p - 1) / m stage-shares of time instead of p. Requests are independent
in attention, so splitting them changes no result; every rank derives the same groups from
the step's inputs, which all ranks hold.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import Any

import torch

from paged.distributed import isend_to_stage, parallel, recv_from_stage
from paged.model.attention import AttentionMetadata, plan_groups

GROUPS_PER_STAGE = 2  # micro-batches per step by default: this many per stage
# ...each of at least this many tokens. Every group reads the stage's weights again, so
# splitting pays only where a step is compute-bound (prefill), not for a memory-bound
# decode batch, whose groups would each cost nearly what the whole batch costs.
MIN_GROUP_TOKENS = 256


@dataclass
class MicroBatch:
    tokens: slice  # of the step's flat tokens
    meta: AttentionMetadata
    rows: list[int]  # token indices, local to the group, whose hidden states become logits


def split_step(
    meta: AttentionMetadata, logits_rows: list[int], groups: int, min_tokens: int = 1
) -> list[MicroBatch]:
    """Contiguous groups of requests (at most `groups`, of about `min_tokens` or more) of
    about equal token counts."""
    qlens = meta.query_lens_cpu
    m = max(1, min(groups, meta.num_reqs, meta.num_tokens // max(min_tokens, 1)))
    cuts, acc, target = [0], 0, meta.num_tokens / m
    for i, q in enumerate(qlens[:-1]):
        acc += q
        left_reqs, left_groups = meta.num_reqs - (i + 1), m - len(cuts)
        if left_groups > 0 and (acc >= target * len(cuts) or left_reqs == left_groups):
            cuts.append(i + 1)
    cuts.append(meta.num_reqs)
    out, t0 = [], 0
    for r0, r1 in zip(cuts, cuts[1:]):
        t1 = t0 + sum(qlens[r0:r1])
        lo, hi = bisect_left(logits_rows, t0), bisect_left(logits_rows, t1)
        rows = [t - t0 for t in logits_rows[lo:hi]]
        out.append(MicroBatch(slice(t0, t1), sub_metadata(meta, r0, r1, t0, t1), rows))
        t0 = t1
    return out


def aligned(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a copy where its data does not start on 16 bytes: a Triton kernel is compiled
    per alignment of each pointer it gets (worker/input_buffers.Layout), so a group's slices
    would otherwise make kernel variants of their own, compiled mid-serving."""
    return t if t.data_ptr() % 16 == 0 else t.clone()


def sub_metadata(meta: AttentionMetadata, r0: int, r1: int, t0: int, t1: int) -> AttentionMetadata:
    """The metadata of requests [r0, r1), whose tokens are [t0, t1) of the step."""
    q, s = meta.query_lens_cpu[r0:r1], meta.seq_lens_cpu[r0:r1]
    return AttentionMetadata(
        num_reqs=r1 - r0,
        num_decodes=max(0, min(meta.num_decodes, r1) - r0),  # decodes come first
        num_tokens=t1 - t0,
        query_start_loc=meta.query_start_loc[r0 : r1 + 1] - t0,
        seq_lens=aligned(meta.seq_lens[r0:r1]),
        block_tables=aligned(meta.block_tables[r0:r1]),
        slot_mapping=aligned(meta.slot_mapping[t0:t1]),
        max_query_len=max(q),
        max_seq_len=max(s),
        query_lens_cpu=q,
        seq_lens_cpu=s,
        group_views=[sub_metadata(v, r0, r1, t0, t1) for v in meta.group_views],
    )


def pipeline_forward(
    model: Any,
    backend: Any,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    meta: AttentionMetadata,
    logits_idx: torch.Tensor,
    hidden_size: int,
    dtype: torch.dtype,
    micro_batches: int = 0,
) -> torch.Tensor | None:
    """This stage's part of the step, in `micro_batches` groups at most (0: GROUPS_PER_STAGE
    per stage, of MIN_GROUP_TOKENS or more). On the first stage: the final hidden states of
    the `logits_idx` rows (sent back by the last stage), None when there are none; None
    elsewhere."""
    p = parallel()
    rows = logits_idx.tolist()
    if micro_batches:
        groups = split_step(meta, rows, micro_batches)
    else:
        groups = split_step(meta, rows, GROUPS_PER_STAGE * p.pp_size, MIN_GROUP_TOKENS)
    device = input_ids.device
    pending: list[Any] = []  # sends in flight (their tensors stay alive until they complete)

    def run(mb: MicroBatch, carried: tuple[torch.Tensor, ...] | None = None) -> Any:
        ids, pos = input_ids[mb.tokens], aligned(positions[mb.tokens])
        return model(ids, pos, plan_groups(backend, mb.meta), carried)

    if p.is_first_stage:
        for mb in groups:  # compute group k+1 while the next stage works on group k
            pending += isend_to_stage(list(run(mb)), 1)
        out = []
        for mb in groups:
            if mb.rows:
                like = torch.empty(len(mb.rows), hidden_size, dtype=dtype, device=device)
                out.append(recv_from_stage([like], p.pp_size - 1)[0])
        _wait(pending)
        return torch.cat(out) if out else None
    for mb in groups:
        n = mb.tokens.stop - mb.tokens.start
        like = [torch.empty(n, hidden_size, dtype=dtype, device=device) for _ in range(2)]
        out = run(mb, tuple(recv_from_stage(like, p.pp_rank - 1)))
        if not p.is_last_stage:
            pending += isend_to_stage(list(out), p.pp_rank + 1)
        elif mb.rows:
            pending += isend_to_stage([out[torch.tensor(mb.rows, device=device)]], 0)
    _wait(pending)
    return None


def _wait(pending: list[Any]) -> None:
    for work, _tensor in pending:
        work.wait()
