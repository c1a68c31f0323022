"""CPU attention over the paged KV cache with torch ops.

Decodes run as one batched SDPA over K/V gathered through the block table (padded to the
longest context, masked); prefill chunks run one SDPA per request, causal over the cached
context plus the new tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from paged.model.attention import AttentionBackend, AttentionMetadata


@dataclass
class CpuPlan:
    decode_table: torch.Tensor | None  # [num_decodes, blocks] int64
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, blocks * block_size]: True = pad
    decode_len: int
    prefills: list[tuple[int, int, int, torch.Tensor | None, torch.Tensor | None]]
    # (token start, token end, context length, block ids or None, mask or None)


class CpuAttentionBackend(AttentionBackend):
    name = "cpu-torch"

    def plan(self, meta: AttentionMetadata) -> AttentionMetadata:
        bs, nd = self.block_size, meta.num_decodes
        table, mask, dlen = None, None, 0
        if nd:
            nblocks = -(-max(meta.seq_lens_cpu[:nd]) // bs)
            dlen = nblocks * bs
            table = meta.block_tables[:nd, :nblocks].long()
            pos = torch.arange(dlen)
            mask = (pos[None, :] >= meta.seq_lens[:nd, None]).view(nd, 1, 1, dlen)
        prefills = []
        start = sum(meta.query_lens_cpu[:nd])
        for i in range(nd, meta.num_reqs):
            qlen, seq = meta.query_lens_cpu[i], meta.seq_lens_cpu[i]
            ctx = seq - qlen
            blocks = pmask = None
            if ctx > 0:  # earlier chunks or a prefix-cache hit: read K/V from the cache
                blocks = meta.block_tables[i, : -(-seq // bs)].long()
                rows = torch.arange(qlen)[:, None] + ctx
                pmask = torch.arange(seq)[None, :] <= rows
            prefills.append((start, start + qlen, seq, blocks, pmask))
            start += qlen
        meta.extra = CpuPlan(table, mask, dlen, prefills)
        return meta

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        plan: CpuPlan = meta.extra
        h, d = self.num_kv_heads, self.head_dim
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        slots = meta.slot_mapping
        k_cache.view(-1, h, d).index_copy_(0, slots, k)
        v_cache.view(-1, h, d).index_copy_(0, slots, v)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:  # one batched matmul pair: SDPA's kernels are slow for single-token queries
            n, group = plan.decode_len, self.num_heads // h
            kd = k_cache[plan.decode_table].view(nd, n, h, d).permute(0, 2, 3, 1)
            vd = v_cache[plan.decode_table].view(nd, n, h, d).transpose(1, 2)
            scores = torch.matmul(q[:nd].view(nd, h, group, d), kd).float() * self.scale
            scores.masked_fill_(plan.decode_mask, float("-inf"))
            probs = scores.softmax(-1).to(q.dtype)
            out[:nd] = torch.matmul(probs, vd).view(nd, h * group, d)
        for s, e, seq, blocks, mask in plan.prefills:
            qi = q[s:e].transpose(0, 1)
            if blocks is None:
                ki, vi = k[s:e].transpose(0, 1), v[s:e].transpose(0, 1)
            else:
                ki = k_cache[blocks].view(-1, h, d)[:seq].transpose(0, 1)
                vi = v_cache[blocks].view(-1, h, d)[:seq].transpose(0, 1)
            o = F.scaled_dot_product_attention(
                qi,
                ki,
                vi,
                attn_mask=mask,
                is_causal=mask is None,
                scale=self.scale,
                enable_gqa=True,
            )
            out[s:e] = o.transpose(0, 1)
        return out
