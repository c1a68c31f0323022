"""CPU attention over the paged KV cache with torch ops.

The cache is head-major, [2, kv_heads, blocks, block_size, head_dim], so that one gather
through the block table yields each head's context as a contiguous [tokens, head_dim]
matrix, ready for batched matmuls without a second copy. Decodes run as two batched
matmuls over that gather (padded to the longest context, masked); prefill chunks run one
SDPA per request, causal over the cached context plus the new tokens.

Per-layer options: a sliding window (keys at positions > query position - window, HF's
semantics) gathers only the blocks from each query's window on (the KV cache may have released
the ones before it: their table entries are the null block) and masks the rest; a softcap
(Gemma 2) runs the scores through cap * tanh(s / cap) in float32 instead of SDPA. The C++
decode kernel has neither: such layers decode with torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from paged.model.attention import AttentionBackend, AttentionMetadata
from paged.model.kv_quant import FP8_DTYPES, dequantize, quantize


@dataclass
class CpuPlan:
    decode_table: torch.Tensor | None  # [num_decodes, blocks] int64
    decode_mask: torch.Tensor | None  # [1, num_decodes, 1, blocks * block_size]: True = pad
    decode_len: int
    prefills: list[tuple[int, int, int, torch.Tensor | None, torch.Tensor | None]]
    # (token start, token end, context length, block ids or None, mask or None)
    decode_seq_lens: torch.Tensor | None = None  # [num_decodes] int64
    window_plans: dict[int, WindowPlan] = field(default_factory=dict)  # built once a step


@dataclass
class WindowPlan:
    """A step's gathers for one window: decodes read each row's blocks from its window on,
    prefill chunks theirs from the window of their first query on."""

    decode_table: torch.Tensor | None  # [num_decodes, blocks] int64
    decode_mask: torch.Tensor | None  # as CpuPlan's: True = outside the window or past the end
    decode_len: int
    prefills: list[tuple[torch.Tensor | None, int, torch.Tensor]]  # (blocks, first key, mask)


def causal_mask(qlen: int, seq: int, window: int | None, first_key: int = 0) -> torch.Tensor:
    """[qlen, seq - first_key] True where query row i (position seq - qlen + i) sees key
    first_key + j."""
    rows = torch.arange(qlen)[:, None] + (seq - qlen)
    keys = torch.arange(first_key, seq)[None, :]
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


class Dequantized:
    """An fp8 cache half `[kv_heads, ...]` read as stored * scale (per head) in `dtype`: only
    what an index gathers is dequantized."""

    def __init__(self, cache: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
        self.cache, self.dtype, self.per_head = cache, dtype, scale

    def __getitem__(self, index: Any) -> torch.Tensor:
        x = self.cache[index]  # the head dimension first, as every read here keeps it
        return (x.float() * self.per_head.view(-1, *[1] * (x.dim() - 1))).to(self.dtype)

    def like(self, stored: torch.Tensor) -> torch.Tensor:
        """Quantized `[tokens, kv_heads, head_dim]` values as the cache reads them back."""
        return dequantize(stored, self.per_head, self.dtype)


class CpuAttentionBackend(AttentionBackend):
    name = "cpu-torch"
    layer_features = frozenset({"window", "softcap", "scale"})
    quantized_cache_dtypes = frozenset(FP8_DTYPES)

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

    def use_cache_dtype(self, cache_dtype: torch.dtype) -> None:
        """An fp8 cache is written as paged.model.kv_quant.quantize does and read back as
        stored * scale (the C++ kernel's paged_decode_fp8 for decodes, where built); attention
        always sees the cached values, a prompt's own K/V too, as in the Triton kernels."""
        super().use_cache_dtype(cache_dtype)
        if self.quantized_cache and not hasattr(self.native, "paged_decode_fp8"):
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

    def _window_plan(self, plan: CpuPlan, window: int) -> WindowPlan:
        """The gathers and masks of a window layer (built once per step and window)."""
        if window in plan.window_plans:
            return plan.window_plans[window]
        bs = self.block_size
        table, dmask, dlen = None, None, 0
        if plan.decode_table is not None:  # per row: the blocks from seq - window on
            seq = plan.decode_seq_lens
            first = (seq - window).clamp_min(0) // bs
            last = (seq + bs - 1) // bs - 1
            width = int((last - first).max()) + 1
            idx = torch.minimum(first[:, None] + torch.arange(width), last[:, None])
            table = plan.decode_table.gather(1, idx)
            dlen = width * bs
            pos = first[:, None] * bs + torch.arange(dlen)
            hidden = (pos >= seq[:, None]) | (pos < (seq - window)[:, None])
            dmask = hidden.view(1, len(seq), 1, dlen)
        prefills = []
        for s, e, seq, blocks, _ in plan.prefills:
            first = 0
            if blocks is not None:  # the chunk's first query (position seq - qlen) on
                first = max(seq - (e - s) - window + 1, 0) // bs
                blocks = blocks[first:]
            prefills.append((blocks, first * bs, causal_mask(e - s, seq, window, first * bs)))
        plan.window_plans[window] = WindowPlan(table, dmask, dlen, prefills)
        return plan.window_plans[window]

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
        if self.quantized_cache:
            native = native and hasattr(self.native, "paged_decode_fp8")
        if not native and meta.num_decodes and plan.decode_table is None:
            self.torch_decode_layers = True  # a layer check_layer did not announce
            plan = self.plan(meta).extra
        scale = self.scale if scale is None else scale
        decode_table, decode_mask, decode_len = plan.decode_table, plan.decode_mask, plan.decode_len
        prefills = [(blocks, 0, mask) for *_, blocks, mask in plan.prefills]
        if window is not None:
            wp = self._window_plan(plan, window)
            decode_table, decode_mask, decode_len = wp.decode_table, wp.decode_mask, wp.decode_len
            prefills = wp.prefills
        h, d = self.num_kv_heads, self.head_dim
        k_cache, v_cache = kv_cache[0], kv_cache[1]  # [h, blocks, block_size, d]
        slots = meta.slot_mapping
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if self.quantized_cache:  # fp8
            ks, vs = self.kv_scales(kv_cache)
            if native:  # quantizes K/V as it writes them, decodes from the blocks in place
                q = q.contiguous()
                self.native.paged_decode_fp8(q, k.contiguous(), v.contiguous(), k_cache, v_cache,
                                             slots, meta.block_tables, meta.seq_lens, out, nd,
                                             scale, ks, vs)  # fmt: skip
                nd = 0
            kq, vq = quantize(k, ks, self.cache_dtype), quantize(v, vs, self.cache_dtype)
            if not native:  # written as bytes (index_copy_ has no float8 kernels)
                for cache, x in ((k_cache, kq), (v_cache, vq)):
                    raw = cache.view(torch.uint8).view(h, -1, d)
                    raw.index_copy_(1, slots, x.view(torch.uint8).transpose(0, 1))
            k_cache, v_cache = Dequantized(k_cache, ks, q.dtype), Dequantized(v_cache, vs, q.dtype)
            k, v = k_cache.like(kq), v_cache.like(vq)  # what the cache holds, for this chunk
        elif (
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
            n, group = decode_len, self.num_heads // h
            kd = k_cache[:, decode_table].view(h * nd, n, d)
            vd = v_cache[:, decode_table].view(h * nd, n, d)
            qd = q[:nd].view(nd, h, group, d).transpose(0, 1).reshape(h * nd, group, d)
            scores = torch.bmm(qd, kd.transpose(1, 2)).float() * scale
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            scores = scores.view(h, nd, group, n).masked_fill_(decode_mask, float("-inf"))
            probs = scores.softmax(-1).to(q.dtype).view(h * nd, group, n)
            o = torch.bmm(probs, vd).view(h, nd, group, d).transpose(0, 1)
            out[:nd] = o.reshape(nd, h * group, d)
        for (s, e, seq, *_), (blocks, first, mask) in zip(plan.prefills, prefills, strict=True):
            qi = q[s:e].transpose(0, 1)
            if blocks is None:
                ki, vi = k[s:e].transpose(0, 1), v[s:e].transpose(0, 1)
            else:
                ki = k_cache[:, blocks].view(h, -1, d)[:, : seq - first]
                vi = v_cache[:, blocks].view(h, -1, d)[:, : seq - first]
            o = attend(qi, ki, vi, mask, scale, softcap, causal=True)
            out[s:e] = o.transpose(0, 1)
        return out
