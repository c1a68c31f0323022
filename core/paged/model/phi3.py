"""Phi-3, Phi-3.5 and Phi-4-mini: Llama-shaped, with q/k/v fused into `qkv_proj` and gate/up
into `gate_up_proj` in the checkpoint (split at load into the per-projection tensors, so
tensor parallelism shards them as Llama's), LongRoPE (per position: short factors below
original_max_position_embeddings, long ones from there; see llama.longrope_long), partial
rotary (`partial_rotary_factor`: the leading dims of each head rotate, the rest pass through)
and a sliding window on every layer where `sliding_window` is set."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from paged.distributed import tp_all_reduce
from paged.model import ops
from paged.model.attention import AttentionBackend, AttentionMetadata
from paged.model.llama import Attention, LlamaForCausalLM, head_dim_of, rotary_dim
from paged.model.moe import check_silu


class Phi3Attention(Attention):
    def __init__(self, cfg, backend: AttentionBackend, window: int | None, rot_dim: int) -> None:
        super().__init__(cfg, backend, window)
        self.rot_dim = rot_dim

    def from_qkv(
        self, positions: torch.Tensor, qkv: torch.Tensor, meta: AttentionMetadata, rope
    ) -> torch.Tensor:
        q, k, v = qkv.split(self.sizes, dim=-1)
        t, d, r = qkv.shape[0], self.head_dim, self.rot_dim
        q = q.reshape(t, self.num_heads, d)
        k = k.reshape(t, self.num_kv_heads, d)
        v = v.reshape(t, self.num_kv_heads, d)
        if r == d:
            q, k = ops.get("rotary_embedding")(positions, q, k, rope)
        else:  # rotate the leading r dims, pass the rest through (HF's partial rotary)
            qr, kr = ops.get("rotary_embedding")(
                positions, q[..., :r].contiguous(), k[..., :r].contiguous(), rope
            )
            q, k = torch.cat([qr, q[..., r:]], -1), torch.cat([kr, k[..., r:]], -1)
        out = self.attend(q, k, v, meta)
        return tp_all_reduce(self.o_proj(out.reshape(t, -1)))


class Phi3ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg, backend: AttentionBackend, max_model_len: int) -> None:
        check_silu(cfg)
        super().__init__(cfg, backend, max_model_len)
        rot = rotary_dim(cfg)
        for layer in self.layers:
            layer.self_attn = Phi3Attention(cfg, backend, layer.self_attn.window, rot)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._split_fused(weights))

    def _split_fused(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's fused qkv_proj / gate_up_proj as HF's per-projection tensors."""
        cfg = self.config
        d = head_dim_of(cfg)
        q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
        for name, t in weights:
            if ".qkv_proj." in name:
                if t.shape[0] != q + 2 * kv:
                    raise ValueError(f"weight {name}: {t.shape[0]} rows, expected {q + 2 * kv}")
                for part, piece in zip(("q_proj", "k_proj", "v_proj"), t.split([q, kv, kv])):
                    yield name.replace("qkv_proj", part), piece
            elif ".gate_up_proj." in name:
                gate, up = t.chunk(2, dim=0)
                yield name.replace("gate_up_proj", "gate_proj"), gate
                yield name.replace("gate_up_proj", "up_proj"), up
            else:
                yield name, t
