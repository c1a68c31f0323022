"""Mixtral: Mistral attention and, in every layer, eight experts (`block_sparse_moe`, experts
w1 = gate, w3 = up, w2 = down) of which the router's top two run, their softmax weights
renormalised to sum to one (kept in float32, as HF does); its sliding_window on every layer."""

from __future__ import annotations

from torch import nn

from paged.model.attention import AttentionBackend
from paged.model.llama import Attention, sliding_window
from paged.model.moe import Layer, MoECausalLM, SparseMoE


class MixtralForCausalLM(MoECausalLM):
    def make_layer(self, cfg, backend: AttentionBackend, index: int) -> nn.Module:
        moe = SparseMoE(
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.num_local_experts,
            cfg.num_experts_per_tok,
            renormalize=True,
            weights_in_model_dtype=False,
        )
        window = sliding_window(cfg, index, self.max_model_len)
        return Layer(cfg, Attention(cfg, backend, window), moe)
