"""Attention over the paged KV cache for XLA: static shapes only.

Cache layout per layer (the ragged paged attention kernel's): `[num_blocks, block_size,
2 * kv_heads, head_dim]`, K and V interleaved per head (K at even rows, V at odd).

On TPU: torch_xla's Pallas ragged paged attention kernel
(`torch.ops.xla.ragged_paged_attention`, torch_xla 2.9 `experimental/custom_kernel.py`),
head_dim padded to 128 lanes in the cache. Elsewhere (XLA:CPU, tests): a pure-torch path
with no data-dependent control flow: every token gathers its request's whole block table
(padded to max_model_len), a mask keeps keys at positions <= its own, softmax in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from paged.model.attention import AttentionBackend, AttentionMetadata
from paged_tpu.buckets import Layout

ATTENTION_ENV = "PAGED_TPU_ATTENTION"  # the tpu_attention option's fallback
CHOICES = ("auto", "pallas", "torch")
KERNEL_LANES = 128  # the Pallas kernel wants head_dim a multiple of the TPU lane count


def use_pallas_kernel(choice: str = "auto") -> bool:
    """`choice`: the tpu_attention option (`--tpu-attention`, fallback PAGED_TPU_ATTENTION):
    auto picks the Pallas kernel on TPU chips, the torch path elsewhere."""
    if choice not in CHOICES:
        raise ValueError(f"tpu_attention={choice!r}: use auto, pallas or torch")
    if choice != "auto":
        return choice == "pallas"
    from paged_tpu.platform import pjrt_device, tpu_chips

    return pjrt_device() in ("", "TPU") and tpu_chips() > 0


@dataclass
class TpuInputs:
    """Token-level inputs the step runner puts in `meta.extra` before `plan()`."""

    positions: torch.Tensor  # int32 [T]
    req_idx: torch.Tensor  # int32 [T]: the request row of each token
    num_seqs: torch.Tensor  # int32 [1]: real requests (the rest is padding)


@dataclass
class TpuPlan:
    num_seqs: torch.Tensor
    token_tables: torch.Tensor | None  # int64 [T, max_blocks] (torch path)
    mask: torch.Tensor | None  # bool [T, 1, 1, max_blocks * block_size] (torch path)


def unpack(
    buf: torch.Tensor, layout: Layout, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
    """The padded step in `buf` (see buckets.pack_step) as (input ids, positions, metadata,
    each request's last token row): static slices only, so it traces into the program."""
    x = {name: buf[lo:hi] for name, (lo, hi) in layout.fields().items()}
    r = layout.reqs
    meta = AttentionMetadata(
        num_reqs=r,
        num_decodes=0,
        num_tokens=layout.tokens,
        query_start_loc=x["query_start_loc"],
        seq_lens=x["seq_lens"],
        block_tables=x["block_tables"].view(r, layout.blocks),
        slot_mapping=x["slots"].long(),
        max_query_len=layout.tokens,
        max_seq_len=layout.blocks * block_size,
        extra=TpuInputs(x["positions"], x["req_idx"], x["num_seqs"]),
    )
    return x["input_ids"], x["positions"], meta, x["last_rows"]


class TpuAttentionBackend(AttentionBackend):
    name = "xla-torch"

    def __init__(self, *args, attention: str = "auto", **kwargs) -> None:
        """`attention`: the platform's tpu_attention option (auto | pallas | torch)."""
        super().__init__(*args, **kwargs)
        self.use_kernel = use_pallas_kernel(attention)
        if self.use_kernel:
            self.name = "tpu-ragged-paged"
        lanes = KERNEL_LANES if self.use_kernel else 1
        self.cache_head_dim = -(-self.head_dim // lanes) * lanes

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.block_size, 2 * self.num_kv_heads, self.cache_head_dim)

    def plan(self, meta: AttentionMetadata) -> AttentionMetadata:
        inp: TpuInputs = meta.extra
        if self.use_kernel:
            meta.extra = TpuPlan(inp.num_seqs, None, None)
            return meta
        tables = meta.block_tables.long()[inp.req_idx.long()]
        keys = torch.arange(tables.shape[1] * self.block_size, device=tables.device)
        mask = keys[None, :] <= inp.positions.long()[:, None]
        meta.extra = TpuPlan(inp.num_seqs, tables, mask[:, None, None, :])
        return meta

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        self.write(kv_cache, meta.slot_mapping, k, v)
        if self.use_kernel:
            return self._kernel(q, kv_cache, meta)
        return self._torch(q, kv_cache, meta.extra)

    def write(
        self, kv_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """k/v [T, kv_heads, D] into the cache at `slots`; out-of-range slots are dropped."""
        kv = torch.stack((k, v), dim=2).flatten(1, 2)  # [T, 2H, D], K/V interleaved
        pad = self.cache_head_dim - self.head_dim
        if pad:
            kv = F.pad(kv, (0, pad))
        flat = kv_cache.flatten(0, 1)  # a view: [num_blocks * block_size, 2H, D]
        if kv_cache.device.type != "xla":  # eager torch raises on the padding slot
            keep = slots < flat.shape[0]
            slots, kv = slots[keep], kv[keep]
        flat.index_copy_(0, slots, kv.to(flat.dtype))

    def _torch(self, q: torch.Tensor, kv_cache: torch.Tensor, plan: TpuPlan) -> torch.Tensor:
        t, hq, d = q.shape
        h = self.num_kv_heads
        kv = kv_cache[plan.token_tables]  # [T, W, block_size, 2H, Dc]
        kv = kv.view(t, -1, h, 2, self.cache_head_dim)[..., :d]
        k, v = kv[..., 0, :].float(), kv[..., 1, :].float()  # [T, L, H, D]
        qg = q.view(t, h, hq // h, d).float()
        scores = torch.einsum("thgd,tlhd->thgl", qg, k) * self.scale
        scores = scores.masked_fill(~plan.mask, float("-inf"))
        out = torch.einsum("thgl,tlhd->thgd", scores.softmax(-1), v)
        return out.reshape(t, hq, d).to(q.dtype)

    def _kernel(
        self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        import torch_xla.experimental.custom_kernel  # noqa: F401  (registers the op)

        d = self.head_dim
        if self.cache_head_dim != d:
            q = F.pad(q, (0, self.cache_head_dim - d))
        out = torch.ops.xla.ragged_paged_attention(
            q,
            kv_cache,
            meta.seq_lens,  # kv_lens [R]
            meta.block_tables,  # page_indices [R, W]
            meta.query_start_loc,  # cu_q_lens [R + 1]
            meta.extra.num_seqs,
            sm_scale=self.scale,
            use_kernel=True,
        )
        return out[..., :d]
