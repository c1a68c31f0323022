"""The simplest correct paged attention: per sequence, gather its K/V through the block
table, then softmax(q k^T * scale) v under a causal mask, in plain torch."""

from __future__ import annotations

import torch

from paged.model.attention import AttentionBackend, AttentionMetadata


class GatherAttentionBackend(AttentionBackend):
    name = "example-gather"

    # kv_cache_shape: the default [2, num_blocks, block_size, kv_heads, head_dim] is kept.

    def plan(self, meta: AttentionMetadata) -> AttentionMetadata:
        # Once per step, shared by all layers: each sequence's block ids, as int64 indices.
        bs = self.block_size
        meta.extra = [
            meta.block_tables[i, : -(-seq // bs)].long() for i, seq in enumerate(meta.seq_lens_cpu)
        ]
        return meta

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        h, d = self.num_kv_heads, self.head_dim
        group = self.num_heads // h
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        # 1. Write this step's keys and values at their slots (slot -1 is padding).
        keep = meta.slot_mapping >= 0
        slots = meta.slot_mapping[keep]
        k_cache.view(-1, h, d).index_copy_(0, slots, k[keep])
        v_cache.view(-1, h, d).index_copy_(0, slots, v[keep])
        # 2. Attend, one sequence at a time.
        out = torch.empty_like(q)
        start = 0
        for blocks, qlen, seq in zip(meta.extra, meta.query_lens_cpu, meta.seq_lens_cpu):
            keys = k_cache[blocks].view(-1, h, d)[:seq].repeat_interleave(group, dim=1)
            vals = v_cache[blocks].view(-1, h, d)[:seq].repeat_interleave(group, dim=1)
            qi = q[start : start + qlen]  # [qlen, heads, d]
            scores = torch.einsum("qhd,khd->hqk", qi.float(), keys.float()) * self.scale
            # Query row r sits at position seq - qlen + r and sees keys at positions <= that.
            rows = torch.arange(qlen)[:, None] + (seq - qlen)
            scores.masked_fill_(torch.arange(seq)[None, :] > rows, float("-inf"))
            probs = scores.softmax(-1)
            attended = torch.einsum("hqk,khd->qhd", probs, vals.float())
            out[start : start + qlen] = attended.to(q.dtype)
            start += qlen
        return out
