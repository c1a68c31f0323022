"""Qwen3 and Qwen3-MoE: Llama-shaped, with an RMSNorm over each query and key head (`q_norm`,
`k_norm`, before the rotary embedding) and no q/k/v bias; Qwen3-MoE replaces the MLP of its
sparse layers by top-k routed experts (`norm_topk_prob`: renormalise the top k weights)."""

from __future__ import annotations

import torch
from torch import nn

from paged.distributed import tp_all_reduce
from paged.model import ops
from paged.model.attention import AttentionBackend, AttentionMetadata
from paged.model.llama import MLP, Attention, LlamaForCausalLM, RMSNorm
from paged.model.moe import Layer, MoECausalLM, SparseMoE, check_silu


def check_no_sliding_window(cfg) -> None:
    if getattr(cfg, "use_sliding_window", False):
        arch = (getattr(cfg, "architectures", None) or ["Qwen3"])[0]
        raise ValueError(f"{arch}: use_sliding_window=true is not supported")


class Qwen3Attention(Attention):
    def __init__(self, cfg, backend: AttentionBackend) -> None:
        super().__init__(cfg, backend)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def from_qkv(
        self, positions: torch.Tensor, qkv: torch.Tensor, meta: AttentionMetadata, rope
    ) -> torch.Tensor:
        q, k, v = qkv.split(self.sizes, dim=-1)
        t, d = qkv.shape[0], self.head_dim
        q = q.view(t, self.num_heads, d)
        k = k.view(t, self.num_kv_heads, d)
        v = v.view(t, self.num_kv_heads, d)
        q, k = ops.get("qk_norm_rotary")(positions, q, k, rope, self.q_norm.weight,
                                         self.k_norm.weight, self.q_norm.eps)  # fmt: skip
        out = self.attend(q, k, v, meta)
        return tp_all_reduce(self.o_proj(out.reshape(t, -1)))


class Qwen3ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg, backend: AttentionBackend, max_model_len: int) -> None:
        check_silu(cfg)
        check_no_sliding_window(cfg)
        super().__init__(cfg, backend, max_model_len)
        self.layers = nn.ModuleList(
            Layer(cfg, Qwen3Attention(cfg, backend), MLP(cfg))
            for _ in range(self.start_layer, self.end_layer)
        )


def is_sparse(cfg, index: int) -> bool:
    """HF's rule for which Qwen3-MoE layers have experts."""
    return (
        index not in (getattr(cfg, "mlp_only_layers", None) or [])
        and cfg.num_experts > 0
        and (index + 1) % cfg.decoder_sparse_step == 0
    )


class Qwen3MoeForCausalLM(MoECausalLM):
    def __init__(self, cfg, backend: AttentionBackend, max_model_len: int) -> None:
        check_no_sliding_window(cfg)
        super().__init__(cfg, backend, max_model_len)

    def make_layer(self, cfg, backend: AttentionBackend, index: int) -> nn.Module:
        if is_sparse(cfg, index):
            mlp = SparseMoE(
                cfg.hidden_size,
                cfg.moe_intermediate_size,
                cfg.num_experts,
                cfg.num_experts_per_tok,
                renormalize=bool(cfg.norm_topk_prob),
                weights_in_model_dtype=True,  # HF casts the routing weights to the model dtype
            )
        else:
            mlp = MLP(cfg)
        return Layer(cfg, Qwen3Attention(cfg, backend), mlp)
