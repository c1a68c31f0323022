"""CPU attention over the paged KV cache with torch ops.

The cache is head-major, [2, kv_heads, blocks, block_size, head_dim], so that one gather
through the block table yields each head's context as a contiguous [tokens, head_dim]
matrix, ready for batched matmuls without a second copy. Decodes run as two batched
matmuls over that gather (padded to the longest context, masked); prefill chunks run one
SDPA per request, causal over the cached context plus the new tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from paged.model.attention import AttentionBackend, AttentionMetadata


@dataclass
class CpuPlan:
    decode_table: torch.Tensor | None  # [num_decodes, blocks] int64
    decode_mask: torch.Tensor | None  # [1, num_decodes, 1, blocks * block_size]: True = pad
    decode_len: int
    prefills: list[tuple[int, int, int, torch.Tensor | None, torch.Tensor | None]]
    # (token start, token end, context length, block ids or None, mask or None)


class CpuAttentionBackend(AttentionBackend):
    name = "cpu-torch"

    def __init__(self, *args, native: bool = True, **kwargs) -> None:
        """`native`: use the C++ decode kernel where built (the platform's cpu_native)."""
        super().__init__(*args, **kwargs)
        from paged_cpu.native import kernels

        self.native = kernels(native)  # the C++ decode kernel, or None: torch ops
        if self.native is not None:
            self.name = "cpu-native"

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (2, self.num_kv_heads, num_blocks, self.block_size, self.head_dim)

    def plan(self, meta: AttentionMetadata) -> AttentionMetadata:
        bs, nd = self.block_size, meta.num_decodes
        table, mask, dlen = None, None, 0
        if nd and self.native is None:
            nblocks = -(-max(meta.seq_lens_cpu[:nd]) // bs)
            dlen = nblocks * bs
            table = meta.block_tables[:nd, :nblocks].long()
            pos = torch.arange(dlen)
            mask = (pos[None, :] >= meta.seq_lens[:nd, None]).view(1, nd, 1, dlen)
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
        k_cache, v_cache = kv_cache[0], kv_cache[1]  # [h, blocks, block_size, d]
        slots = meta.slot_mapping
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if self.native is not None:  # writes K/V, decodes from the blocks in place
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
            self.native.paged_decode(
                q,
                k,
                v,
                k_cache,
                v_cache,
                slots,
                meta.block_tables,
                meta.seq_lens,
                out,
                nd,
                self.scale,
            )
            nd = 0
        else:
            k_cache.view(h, -1, d).index_copy_(1, slots, k.transpose(0, 1))
            v_cache.view(h, -1, d).index_copy_(1, slots, v.transpose(0, 1))
        if nd:  # batched matmuls over (head, request): SDPA is slow for one-token queries
            n, group = plan.decode_len, self.num_heads // h
            kd = k_cache[:, plan.decode_table].view(h * nd, n, d)
            vd = v_cache[:, plan.decode_table].view(h * nd, n, d)
            qd = q[:nd].view(nd, h, group, d).transpose(0, 1).reshape(h * nd, group, d)
            scores = torch.bmm(qd, kd.transpose(1, 2)).float() * self.scale
            scores = scores.view(h, nd, group, n).masked_fill_(plan.decode_mask, float("-inf"))
            probs = scores.softmax(-1).to(q.dtype).view(h * nd, group, n)
            o = torch.bmm(probs, vd).view(h, nd, group, d).transpose(0, 1)
            out[:nd] = o.reshape(nd, h * group, d)
        for s, e, seq, blocks, mask in plan.prefills:
            qi = q[s:e].transpose(0, 1)
            if blocks is None:
                ki, vi = k[s:e].transpose(0, 1), v[s:e].transpose(0, 1)
            else:
                ki = k_cache[:, blocks].view(h, -1, d)[:, :seq]
                vi = v_cache[:, blocks].view(h, -1, d)[:, :seq]
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
