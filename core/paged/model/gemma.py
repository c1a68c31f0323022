"""Gemma 2 and Gemma 3 (text): Llama-shaped attention and gated MLP with Gemma's differences.

Embeddings scaled by sqrt(hidden_size) (in the model dtype, as HF); RMSNorms scaling by
(1 + weight) in float32; norms after attention and around the MLP (pre/post feed-forward);
a GeGLU MLP (gelu_pytorch_tanh); a softmax scale of query_pre_attn_scalar ** -0.5; sliding
and global layers by config.layer_types. Gemma 2 soft-caps attention scores and final
logits (cap * tanh(x / cap)); Gemma 3 RMS-normalises each query and key head before the
rotary embedding, whose theta differs between sliding (rope_local_base_freq) and global
layers (rope_theta, maybe scaled): one rotary table per layer type.
"""

from __future__ import annotations

import torch
from torch import nn

from paged.distributed import tp_all_reduce
from paged.model import ops
from paged.model.attention import AttentionBackend, AttentionMetadata, layer_options
from paged.model.llama import MLP, Attention, LlamaForCausalLM, rope_cache, sliding_window

_GELU = {"gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu": "none"}


class GemmaRMSNorm(nn.Module):
    """HF's Gemma norm: x * rsqrt(mean(x^2) + eps) * (1 + w), all in float32, then cast."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.get("gemma_rms_norm")(x, self.weight, self.eps)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(residual + x), residual + x) in one fused op; the inputs are unchanged."""
        return ops.get("gemma_add_rms_norm")(x, residual, self.weight, self.eps)


class GemmaAttention(Attention):
    def __init__(self, cfg, backend: AttentionBackend, window: int | None, qk_norm: bool) -> None:
        super().__init__(cfg, backend)
        softcap = getattr(cfg, "attn_logit_softcapping", None)
        scale = float(cfg.query_pre_attn_scalar) ** -0.5
        self.window = window
        self.attn_opts, self.q_mult = layer_options(backend, window, softcap, scale)
        self.q_norm = self.k_norm = None
        if qk_norm:
            self.q_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps)

    def from_qkv(
        self, positions: torch.Tensor, qkv: torch.Tensor, meta: AttentionMetadata, rope
    ) -> torch.Tensor:
        q, k, v = qkv.split(self.sizes, dim=-1)
        t, d = qkv.shape[0], self.head_dim
        q = q.reshape(t, self.num_heads, d)
        k = k.reshape(t, self.num_kv_heads, d)
        v = v.reshape(t, self.num_kv_heads, d)
        if self.q_norm is not None:  # Gemma 3: each head normalised, then rotated
            norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
            q, k = ops.get("qk_norm_rotary")(positions, q, k, rope, *norms, gemma=True)
        else:
            q, k = ops.get("rotary_embedding")(positions, q, k, rope)
        if self.q_mult != 1.0:  # the layer's scale, where the backend takes none
            q = q * self.q_mult
        out = self.attend(q, k, v, meta)
        return tp_all_reduce(self.o_proj(out.reshape(t, -1)))


class GemmaMLP(MLP):
    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        act = getattr(cfg, "hidden_activation", None) or cfg.hidden_act
        if act not in _GELU:
            raise ValueError(f"Gemma: hidden_activation {act!r} is not supported")
        self.approximate = _GELU[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = ops.get("gelu_and_mul")(self.gate_up_proj(x), self.approximate)
        return tp_all_reduce(self.down_proj(h))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg, backend: AttentionBackend, index: int, max_model_len: int) -> None:
        super().__init__()
        types = getattr(cfg, "layer_types", None)
        self.layer_type = types[index] if types else "full_attention"
        window = sliding_window(cfg, index, max_model_len)
        self.self_attn = GemmaAttention(cfg, backend, window, qk_norm=cfg.model_type != "gemma2")
        self.mlp = GemmaMLP(cfg)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, positions, x, residual, meta, rope):
        """The stream's hidden state is x + residual (x alone in the first layer); returns the
        MLP's output and the residual it is added to, as HF adds them. Each add is fused with
        the norm that follows it."""
        if residual is None:
            h = self.input_layernorm(x)
        else:
            h, x = self.input_layernorm.add_forward(x, residual)
        h = self.post_attention_layernorm(self.self_attn(positions, h, meta, rope))
        h, residual = self.pre_feedforward_layernorm.add_forward(h, x)
        h = self.post_feedforward_layernorm(self.mlp(h))
        return h, residual


def gemma3_rope_cache(cfg, layer_type: str, max_len: int) -> torch.Tensor:
    """Gemma 3's table for one layer type: its own rope_parameters (theta, maybe scaling)."""
    params = cfg.rope_parameters[layer_type]
    rope_type = params.get("rope_type", "default")
    dim = cfg.head_dim
    if rope_type == "default":
        inv_freq = 1.0 / (
            params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
        )
        scaling = 1.0
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu", layer_type=layer_type)
    freqs = torch.arange(max_len, dtype=torch.float)[:, None] * inv_freq.float()
    return torch.cat((freqs.cos() * scaling, freqs.sin() * scaling), dim=-1)


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma2ForCausalLM and Gemma3ForCausalLM (the text model)."""

    def __init__(self, cfg, backend: AttentionBackend, max_model_len: int) -> None:
        super().__init__(cfg, backend, max_model_len)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(cfg, backend, i, max_model_len)
            for i in range(self.start_layer, self.end_layer)
        )
        if self.last:
            self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.final_softcap = getattr(cfg, "final_logit_softcapping", None) or None
        self.rope_tables: dict[str, torch.Tensor] = {}

    def init_rope(self, device: torch.device) -> None:
        cfg, n = self.config, self.max_model_len
        types = {layer.layer_type for layer in self.layers}
        nested = isinstance(getattr(cfg, "rope_parameters", None), dict) and all(
            t in cfg.rope_parameters for t in types
        )
        for t in types:  # Gemma 3: per-type parameters; Gemma 2: one for all
            table = gemma3_rope_cache(cfg, t, n) if nested else rope_cache(cfg, n)
            self.rope_tables[t] = table.to(device)
        self.cos_sin = next(iter(self.rope_tables.values()), None)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if intermediate is None:
            x, residual = self.embed_tokens(input_ids), None
            x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        else:
            x, residual = intermediate
        prepare = ops.get("rotary_prepare")
        ropes = {t: prepare(positions, table, x.dtype) for t, table in self.rope_tables.items()}
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta, ropes[layer.layer_type])
        if not self.last:
            return x, residual
        return self.norm(x) if residual is None else self.norm.add_forward(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden)
        if logits is None or self.final_softcap is None:
            return logits
        return torch.tanh(logits / self.final_softcap) * self.final_softcap
