"""Micro-batches of a pipeline-parallel step (worker/pipeline.py): the groups cover the step's
requests and tokens exactly once, in order, with their own metadata and logits rows."""

import torch

from paged.model.attention import AttentionMetadata
from paged.worker.pipeline import split_step


def metadata(qlens: list[int], seqs: list[int], num_decodes: int) -> AttentionMetadata:
    ends = torch.tensor([0, *qlens]).cumsum(0).to(torch.int32)
    n = len(qlens)
    return AttentionMetadata(
        num_reqs=n,
        num_decodes=num_decodes,
        num_tokens=sum(qlens),
        query_start_loc=ends,
        seq_lens=torch.tensor(seqs, dtype=torch.int32),
        block_tables=torch.arange(n * 4, dtype=torch.int32).view(n, 4),
        slot_mapping=torch.arange(sum(qlens)),
        max_query_len=max(qlens),
        max_seq_len=max(seqs),
        query_lens_cpu=qlens,
        seq_lens_cpu=seqs,
    )


def test_groups_cover_the_step_in_order():
    qlens, seqs = [1, 1, 1, 20, 5, 30], [9, 12, 7, 20, 40, 30]
    meta = metadata(qlens, seqs, num_decodes=3)
    ends = torch.tensor(qlens).cumsum(0).tolist()
    rows = [e - 1 for e in ends if e != 24]  # every request samples but the 5-token chunk
    groups = split_step(meta, rows, 4)
    assert 1 < len(groups) <= 4
    r0 = t0 = 0
    got_rows = []
    for g in groups:
        m = g.meta
        assert g.tokens.start == t0 and g.tokens.stop == t0 + m.num_tokens
        assert m.query_lens_cpu == qlens[r0 : r0 + m.num_reqs]
        assert m.seq_lens_cpu == seqs[r0 : r0 + m.num_reqs]
        assert m.query_start_loc.tolist() == [0, *torch.tensor(m.query_lens_cpu).cumsum(0)]
        assert m.block_tables.tolist() == meta.block_tables[r0 : r0 + m.num_reqs].tolist()
        assert m.slot_mapping.tolist() == list(range(t0, t0 + m.num_tokens))
        assert m.num_decodes == max(0, min(3, r0 + m.num_reqs) - r0)
        # 16-byte aligned, as the step's own views: one Triton kernel variant per pointer
        assert all(t.data_ptr() % 16 == 0 for t in (m.seq_lens, m.block_tables, m.slot_mapping))
        assert m.max_query_len == max(m.query_lens_cpu)
        got_rows += [t0 + r for r in g.rows]
        r0, t0 = r0 + m.num_reqs, t0 + m.num_tokens
    assert (r0, t0) == (len(qlens), sum(qlens))
    assert got_rows == rows


def test_no_more_groups_than_requests():
    meta = metadata([7, 3], [7, 3], num_decodes=0)
    groups = split_step(meta, [6, 9], 8)
    assert [g.meta.num_reqs for g in groups] == [1, 1]
    assert [g.rows for g in groups] == [[6], [2]]
    one = split_step(metadata([50], [50], 0), [49], 4)
    assert len(one) == 1 and one[0].rows == [49]


def test_groups_hold_a_minimum_of_tokens():
    decode = metadata([1] * 64, [40] * 64, num_decodes=64)
    assert len(split_step(decode, list(range(64)), 4, min_tokens=256)) == 1
    prefill = metadata([300, 300, 300], [300] * 3, num_decodes=0)
    assert len(split_step(prefill, [299, 599, 899], 4, min_tokens=256)) == 3
