"""CPU attention over the paged KV cache with torch ops.

The cache is head-major, [2, kv_heads, blocks, block_size, head_dim], so that one gather
through the block table yields each head's context as a contiguous [tokens, head_dim]
matrix, ready for batched matmuls without a second copy. Decodes run as two batched
matmuls over that gather (padded to the longest context, masked); prefill chunks run one
SDPA per request, causal over the cached context plus the new tokens.

Per-layer options: a sliding window (keys at positions > query position - window, HF's
semantics) is one more mask; a softcap (Gemma 2) runs the scores through cap * tanh(s / cap)
in float32 instead of SDPA. The C++ decode kernel has neither: such layers decode with torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
    decode_seq_lens: torch.Tensor | None = None  # [num_decodes] int64
    window_masks: dict[int, Any] = field(default_factory=dict)  # window -> masks, built once


def causal_mask(qlen: int, seq: int, window: int | None) -> torch.Tensor:
    """[qlen, seq] True where query row i (position seq - qlen + i) sees key j."""
    rows = torch.arange(qlen)[:, None] + (seq - qlen)
    keys = torch.arange(seq)[None, :]
    mask = keys <= rows
    if window is not None:
        mask &= keys > rows - window
    return mask


def attend(q, k, v, mask, scale: float, softcap: float | None, causal: bool) -> torch.Tensor:
    """q [H, Tq, D], k/v [Hkv, Tk, D]; mask [Tq, Tk] (True = visible) or None with `causal`."""
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal and mask is None, scale=scale,
            enable_gqa=True,
        )  # fmt: skip
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    s = torch.matmul(q.float(), k.float().transpose(1, 2)) * scale
    s = torch.tanh(s / softcap) * softcap
    if mask is None:
        mask = causal_mask(q.shape[1], k.shape[1], None)
    s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(s.softmax(-1).to(v.dtype), v)


class CpuAttentionBackend(AttentionBackend):
    name = "cpu-torch"
    layer_features = frozenset({"window", "softcap", "scale"})

    def __init__(self, *args, native: bool = True, **kwargs) -> None:
        """`native`: use the C++ decode kernel where built (the platform's cpu_native)."""
        super().__init__(*args, **kwargs)
        from paged_cpu.native import kernels

        self.native = kernels(native)  # the C++ decode kernel, or None: torch ops
        if self.native is not None:
            self.name = "cpu-native"
        self.torch_decode_layers = False  # a layer the C++ kernel cannot run (window/softcap)

    def check_layer(self, **options: Any) -> None:
        super().check_layer(**options)
        if options.get("window") is not None or options.get("softcap") is not None:
            self.torch_decode_layers = True

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (2, self.num_kv_heads, num_blocks, self.block_size, self.head_dim)

    def plan(self, meta: AttentionMetadata) -> AttentionMetadata:
        bs, nd = self.block_size, meta.num_decodes
        table, mask, dlen = None, None, 0
        seq_lens = None
        if nd and (self.native is None or self.torch_decode_layers):
            nblocks = -(-max(meta.seq_lens_cpu[:nd]) // bs)
            dlen = nblocks * bs
            table = meta.block_tables[:nd, :nblocks].long()
            pos = torch.arange(dlen)
            seq_lens = meta.seq_lens[:nd].long()
            mask = (pos[None, :] >= seq_lens[:, None]).view(1, nd, 1, dlen)
        prefills = []
        start = sum(meta.query_lens_cpu[:nd])
        for i in range(nd, meta.num_reqs):
            qlen, seq = meta.query_lens_cpu[i], meta.seq_lens_cpu[i]
            ctx = seq - qlen
            blocks = pmask = None
            if ctx > 0:  # earlier chunks or a prefix-cache hit: read K/V from the cache
                blocks = meta.block_tables[i, : -(-seq // bs)].long()
                pmask = causal_mask(qlen, seq, None)
            prefills.append((start, start + qlen, seq, blocks, pmask))
            start += qlen
        meta.extra = CpuPlan(table, mask, dlen, prefills, seq_lens)
        return meta

    def _window_masks(self, plan: CpuPlan, window: int) -> tuple[Any, list[torch.Tensor]]:
        """The decode mask and each prefill's mask with the window applied (once per step)."""
        if window not in plan.window_masks:
            dmask = None
            if plan.decode_mask is not None:
                pos = torch.arange(plan.decode_len)
                old = (pos[None, :] < plan.decode_seq_lens[:, None] - window).view(
                    plan.decode_mask.shape
                )
                dmask = plan.decode_mask | old
            pmasks = [causal_mask(e - s, seq, window) for s, e, seq, _, _ in plan.prefills]
            plan.window_masks[window] = (dmask, pmasks)
        return plan.window_masks[window]

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        window: int | None = None,
        softcap: float | None = None,
        scale: float | None = None,
    ) -> torch.Tensor:
        plan: CpuPlan = meta.extra
        native = self.native is not None and window is None and softcap is None
        if not native and meta.num_decodes and plan.decode_table is None:
            self.torch_decode_layers = True  # a layer check_layer did not announce
            plan = self.plan(meta).extra
        scale = self.scale if scale is None else scale
        decode_mask, prefill_masks = plan.decode_mask, [m for *_, m in plan.prefills]
        if window is not None:
            decode_mask, prefill_masks = self._window_masks(plan, window)
        h, d = self.num_kv_heads, self.head_dim
        k_cache, v_cache = kv_cache[0], kv_cache[1]  # [h, blocks, block_size, d]
        slots = meta.slot_mapping
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if (
            self.native is not None and window is None and softcap is None
        ):  # writes K/V, decodes from the blocks in place
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
                scale,
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
            scores = torch.bmm(qd, kd.transpose(1, 2)).float() * scale
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            scores = scores.view(h, nd, group, n).masked_fill_(decode_mask, float("-inf"))
            probs = scores.softmax(-1).to(q.dtype).view(h * nd, group, n)
            o = torch.bmm(probs, vd).view(h, nd, group, d).transpose(0, 1)
            out[:nd] = o.reshape(nd, h * group, d)
        for (s, e, seq, blocks, _), mask in zip(plan.prefills, prefill_masks, strict=True):
            qi = q[s:e].transpose(0, 1)
            if blocks is None:
                ki, vi = k[s:e].transpose(0, 1), v[s:e].transpose(0, 1)
            else:
                ki = k_cache[:, blocks].view(h, -1, d)[:, :seq]
                vi = v_cache[:, blocks].view(h, -1, d)[:, :seq]
            o = attend(qi, ki, vi, mask, scale, softcap, causal=True)
            out[s:e] = o.transpose(0, 1)
        return out
