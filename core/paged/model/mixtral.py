"""Mixtral: Mistral attention and, in every layer, eight experts (`block_sparse_moe`, experts
w1 = gate, w3 = up, w2 = down) of which the router's top two run, their softmax weights
renormalised to sum to one (kept in float32, as HF does)."""

from __future__ import annotations

from torch import nn

from paged.model.attention import AttentionBackend
from paged.model.llama import Attention
from paged.model.moe import Layer, MoECausalLM, SparseMoE


class MixtralForCausalLM(MoECausalLM):
    def __init__(self, cfg, backend: AttentionBackend, max_model_len: int) -> None:
        window = getattr(cfg, "sliding_window", None)
        if window and window < max_model_len:
            raise ValueError(
                f"MixtralForCausalLM: sliding_window {window} is not supported; pass "
                f"max_model_len <= {window} (the window then never applies)"
            )
        super().__init__(cfg, backend, max_model_len)

    def make_layer(self, cfg, backend: AttentionBackend, index: int) -> nn.Module:
        moe = SparseMoE(
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.num_local_experts,
            cfg.num_experts_per_tok,
            renormalize=True,
            weights_in_model_dtype=False,
        )
        return Layer(cfg, Attention(cfg, backend), moe)
