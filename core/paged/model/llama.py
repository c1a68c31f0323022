"""A Llama-family decoder: Llama 2/3, Mistral (sliding window), Qwen2 (q/k/v bias, sliding
layers by layer_types), SmolLM2 (tied embeddings).

Weights are HF-named on load; q/k/v and gate/up are stacked into one matmul each.
Attention goes through the platform's backend over the paged KV cache.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from paged.distributed import parallel, tp_all_reduce, tp_gather_first
from paged.model import ops
from paged.model.attention import AttentionBackend, AttentionMetadata, layer_options
from paged.model.parallel import (
    VocabParallelEmbedding,
    head_shard,
    split_range,
    vocab_shard,
)
from paged.quantization import linear, narrow_in


def rope_params(hf_config) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention scaling) exactly as HF computes them; HF's own init functions
    for scaled variants (llama3, yarn, ...), the plain formula inline (a lighter import)."""
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    rope_type = (params or {}).get("rope_type", (params or {}).get("type", "default"))
    if rope_type == "default":
        base = (params or {}).get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        dim = rotary_dim(hf_config)
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        factors = getattr(hf_config, "rope_freq_factors", None)
        if factors is not None:  # a GGUF's rope_freqs (Llama 3.x): llama.cpp divides by them
            if len(factors) != inv_freq.numel():
                raise ValueError(f"rope_freqs has {len(factors)} factors, rotary needs "
                                 f"{inv_freq.numel()}")  # fmt: skip
            inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float)
        return inv_freq, 1.0
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    with torch.device("cpu"):
        rot = LlamaRotaryEmbedding(hf_config)
    return rot.inv_freq.float(), rot.attention_scaling


def rotary_dim(hf_config) -> int:
    """The rotated leading dims of each head: head_dim x partial_rotary_factor (Phi-4-mini)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0))
    return int(head_dim_of(hf_config) * (factor or 1.0))


def longrope_long(hf_config) -> tuple[int, torch.Tensor] | None:
    """LongRoPE's (original_max_position_embeddings, long-factor inv_freq), or None. HF uses
    the short factors while the sequence fits the original length and the long ones once a
    position reaches it (its rope's longrope_frequency_update): per position here, which is
    what HF computes token by token (a prompt longer than the original length is where HF's
    one-shot prefill rotates every position with the long factors instead)."""
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    if not params or params.get("rope_type", params.get("type")) != "longrope":
        return None
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    orig = params.get("original_max_position_embeddings")
    orig = orig or hf_config.original_max_position_embeddings
    long_inv, _ = ROPE_INIT_FUNCTIONS["longrope"](hf_config, "cpu", seq_len=orig + 1)
    return int(orig), long_inv.float()


def rope_cache(hf_config, max_len: int) -> torch.Tensor:
    """[max_len, rotary_dim] float32: cos in the first half, sin in the second (HF's math)."""
    inv_freq, scaling = rope_params(hf_config)
    pos = torch.arange(max_len, dtype=torch.float)[:, None]
    freqs = pos * inv_freq
    if (long := longrope_long(hf_config)) is not None:
        orig, long_inv = long
        freqs = torch.where(pos < orig, freqs, pos * long_inv)
    return torch.cat((freqs.cos() * scaling, freqs.sin() * scaling), dim=-1)


def sliding_window(cfg, index: int, max_model_len: int) -> int | None:
    """Layer `index`'s sliding window as HF applies it: config.sliding_window on the layers
    config.layer_types marks "sliding_attention" where it lists them, else on every layer
    (Mistral, Mixtral); None where it never applies (no window, or one >= max_model_len)."""
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if types is not None and types[index] != "sliding_attention":
        return None
    if not window or window >= max_model_len:
        return None
    return int(window)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return ops.get("rms_norm")(x, self.weight, self.eps)
        return ops.get("fused_add_rms_norm")(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    """This rank's heads (`shard`); the o_proj output is summed over tensor-parallel ranks."""

    def __init__(self, cfg, backend: AttentionBackend, window: int | None = None) -> None:
        super().__init__()
        p = parallel()
        self.window = window
        self.attn_opts, _ = layer_options(backend, window=window)  # refused here if unsupported
        self.shard = head_shard(cfg.num_attention_heads, cfg.num_key_value_heads, p.tp_size,
                                p.tp_rank)  # fmt: skip
        self.num_heads = self.shard.q_count
        self.num_kv_heads = self.shard.kv_count
        self.head_dim = head_dim_of(cfg)
        bias = getattr(cfg, "attention_bias", False) or cfg.model_type == "qwen2"
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.sizes = (q, kv, kv)
        self.qkv_proj = linear(cfg.hidden_size, q + 2 * kv, bias=bias)  # maybe quantized
        self.o_proj = linear(q, cfg.hidden_size, bias=getattr(cfg, "attention_bias", False))
        self.backend = backend
        self.kv_cache: torch.Tensor | None = None  # bound by the model runner
        self.kv_group = 0  # its KV-cache group (model/kv_groups.py), set with the cache

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        meta: AttentionMetadata,
        rope,
    ) -> torch.Tensor:
        return self.from_qkv(positions, self.qkv_proj(x), meta, rope)

    def from_qkv(
        self, positions: torch.Tensor, qkv: torch.Tensor, meta: AttentionMetadata, rope
    ) -> torch.Tensor:
        """The rest of forward after the QKV projection (whose input norm may be fused with
        it: DecoderLayer)."""
        q, k, v = qkv.split(self.sizes, dim=-1)
        t = qkv.shape[0]
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        out = self.attend(q, k, v, meta, positions, rope)
        return tp_all_reduce(self.o_proj(out.reshape(t, -1)))

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        positions: torch.Tensor | None = None,
        rope=None,
    ) -> torch.Tensor:
        """The backend's attention over this layer's cache, with its group's block tables;
        given `positions` and `rope`, q and k are rotated first (by the backend, which may do
        it inside its kernel)."""
        meta = meta.group(self.kv_group)
        if rope is None:
            return self.backend.forward(q, k, v, self.kv_cache, meta, **self.attn_opts)
        return self.backend.forward_rotary(positions, q, k, v, self.kv_cache, meta, rope,
                                           **self.attn_opts)  # fmt: skip


class MLP(nn.Module):
    """This rank's columns [inter_start, inter_end) of the intermediate layer."""

    def __init__(self, cfg) -> None:
        super().__init__()
        p = parallel()
        self.inter_start, self.inter_end = split_range(cfg.intermediate_size, p.tp_size, p.tp_rank)
        inter = self.inter_end - self.inter_start
        bias = getattr(cfg, "mlp_bias", False)
        self.gate_up_proj = linear(cfg.hidden_size, 2 * inter, bias=bias)
        self.down_proj = linear(inter, cfg.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.from_gate_up(self.gate_up_proj(x))

    def from_gate_up(self, gate_up: torch.Tensor) -> torch.Tensor:
        return tp_all_reduce(ops.get("silu_and_mul_linear")(gate_up, self.down_proj))


class DecoderLayer(nn.Module):
    def __init__(self, cfg, backend: AttentionBackend, window: int | None = None) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, backend, window)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, x, residual, meta, rope):
        """Each residual add, the norm after it and the projection after that in one op
        (add_rms_norm_linear: one kernel for a one-row GEMV on GPUs); an MLP other than the
        dense one (a mixture of experts) likewise, after the norm (add_rms_norm_moe: folded
        into its router and expert GEMVs at decode on GPUs)."""
        attn, mlp = self.self_attn, self.mlp
        if residual is None:
            residual = x
            qkv = attn.qkv_proj(self.input_layernorm(x))
        else:
            qkv, residual = norm_linear(self.input_layernorm, x, residual, attn.qkv_proj)
        x = attn.from_qkv(positions, qkv, meta, rope)
        if type(mlp) is MLP:
            gate_up, residual = norm_linear(self.post_attention_layernorm, x, residual,
                                            mlp.gate_up_proj)  # fmt: skip
            return mlp.from_gate_up(gate_up), residual
        norm = self.post_attention_layernorm
        return ops.get("add_rms_norm_moe")(x, residual, norm.weight, norm.eps, mlp)

    def gated_linears(self) -> list[nn.Module]:
        """The projections whose SiLU-and-mul input forward folds into them
        (silu_and_mul_linear: a dense MLP's down projection)."""
        return [self.mlp.down_proj] if type(self.mlp) is MLP else []

    def normed_linears(self) -> list[nn.Module]:
        """The projections whose input norm forward folds into them (add_rms_norm_linear: the
        QKV and a dense MLP's gate/up; a mixture of experts' norm runs on its own)."""
        mlp = [self.mlp.gate_up_proj] if type(self.mlp) is MLP else []
        return [self.self_attn.qkv_proj, *mlp]


def norm_linear(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor, linear: nn.Module):
    """(linear(norm(x + residual)), x + residual)."""
    return ops.get("add_rms_norm_linear")(x, residual, norm.weight, norm.eps, linear)


class TiedHead(nn.Module):
    """The output projection of tied-embedding models: the embedding matrix, not a copy."""

    bias = None

    def __init__(self, embed: nn.Embedding) -> None:
        super().__init__()
        self._embed = [embed]  # in a list: not a submodule, so its weight is not listed twice

    @property
    def weight(self) -> torch.Tensor:
        return self._embed[0].weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight)


def head_dim_of(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


class LlamaForCausalLM(nn.Module):
    # HF name fragment -> (our stacked parameter, shard index)
    stacked = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg, backend: AttentionBackend, max_model_len: int) -> None:
        """This rank's part: its tensor-parallel shard of its pipeline stage's layers. The
        first stage also holds the embedding and the head (it samples), the last the final
        norm."""
        super().__init__()
        p = parallel()
        self.config = cfg
        self.start_layer, self.end_layer = split_range(cfg.num_hidden_layers, p.pp_size, p.pp_rank)
        self.first, self.last = p.is_first_stage, p.is_last_stage
        self.vocab_start, self.vocab_end = vocab_shard(cfg.vocab_size, p.tp_size, p.tp_rank)
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False))
        self.embed_tokens = self.lm_head = self.norm = None
        if self.first:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
            if self.tied:
                self.lm_head = TiedHead(self.embed_tokens)
            else:
                rows = self.vocab_end - self.vocab_start
                self.lm_head = nn.Linear(cfg.hidden_size, rows, bias=False)
        self.max_model_len = max_model_len
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, backend, sliding_window(cfg, i, max_model_len))
            for i in range(self.start_layer, self.end_layer)
        )
        if self.last:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.cos_sin: torch.Tensor | None = None  # set by init_rope() on the real device
        # EAGLE-3 (spec_decode/eagle.py): layers whose input the forward also returns
        self.aux_layers: tuple[int, ...] = ()

    def init_rope(self, device: torch.device) -> None:
        self.cos_sin = rope_cache(self.config, self.max_model_len).to(device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The final hidden states on the last pipeline stage; (hidden, residual) for the
        next stage elsewhere. Stages after the first start from `intermediate`. With
        `aux_layers` (one stage): the final hidden states followed by the input of each of
        those layers (its residual stream, as vLLM's aux_hidden_state_layers), [tokens,
        (1 + len(aux_layers)) x hidden], one tensor so that a captured graph outputs it."""
        if intermediate is None:
            x, residual = self.embed_tokens(input_ids), None
        else:
            x, residual = intermediate
        rope = ops.get("rotary_prepare")(positions, self.cos_sin, x.dtype)
        aux = []
        for i, layer in enumerate(self.layers, self.start_layer):
            if i in self.aux_layers:  # a copy: the fused norms update the residual in place
                aux.append(x.clone() if residual is None else x + residual)
            x, residual = layer(positions, x, residual, meta, rope)
        if not self.last:
            return x, residual
        x, _ = self.norm(x, residual)
        return torch.cat((x, *aux), dim=-1) if aux else x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Float32 logits over the whole vocabulary on the first tensor-parallel rank (None on
        the others, which only contribute their vocabulary shard)."""
        logits = tp_gather_first(self.lm_head(hidden))
        if logits is None:
            return None
        return logits[..., : self.config.vocab_size].float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy this rank's part of HF-named tensors in (cast to each parameter's dtype);
        returns the names loaded. Tensors of other pipeline stages are skipped."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb" in name or (self.tied and name == "lm_head.weight"):
                continue
            name = self._local_name(name.removeprefix("model."))
            if name is None:
                continue
            if name == "embed_tokens.weight":
                self.embed_tokens.load(tensor)
                loaded.add(name)
                continue
            parts = name.split(".")
            target, shard = name, None
            for frag, (stacked, idx) in self.stacked.items():
                if frag in parts:
                    target, shard = name.replace(frag, stacked), idx
                    break
            if target not in params:
                raise ValueError(f"unexpected weight {name!r} for {type(self).__name__}")
            param = params[target]
            tensor = self._tp_slice(name, parts, tensor)
            with torch.no_grad():
                if shard is None:
                    if param.shape != tensor.shape:
                        raise ValueError(
                            f"weight {name}: shape {tuple(tensor.shape)}, "
                            f"expected {tuple(param.shape)}"
                        )
                    param.copy_(tensor)
                else:
                    sizes = self._shard_sizes(target)
                    start = sum(sizes[:shard])
                    param.narrow(0, start, sizes[shard]).copy_(tensor)
            loaded.add(target if shard is None else f"{target}#{shard}")
        return loaded

    def _local_name(self, name: str) -> str | None:
        """The parameter name on this stage (layers renumbered from 0), or None for a weight
        another stage holds."""
        if name.startswith("layers."):
            _, i, rest = name.split(".", 2)
            i = int(i)
            if not self.start_layer <= i < self.end_layer:
                return None
            return f"layers.{i - self.start_layer}.{rest}"
        if name.startswith("embed_tokens.") and not self.first:
            return None
        if name.startswith("lm_head.") and not self.first:
            return None
        if name.startswith("norm.") and not self.last:
            return None
        return name

    def _tp_slice(self, name: str, parts: list[str], t: torch.Tensor) -> torch.Tensor:
        """This tensor-parallel rank's slice of a full checkpoint tensor."""
        if parallel().tp_size == 1:
            return t
        attn = self.layers[0].self_attn
        hs, d = attn.shard, attn.head_dim
        mlp = self.layers[0].mlp
        if "q_proj" in parts:
            return t.narrow(0, hs.q_start * d, hs.q_count * d)
        if "k_proj" in parts or "v_proj" in parts:
            return t.narrow(0, hs.kv_start * d, hs.kv_count * d)
        if "gate_proj" in parts or "up_proj" in parts:
            return t.narrow(0, mlp.inter_start, mlp.inter_end - mlp.inter_start)
        rank0 = parallel().tp_rank == 0
        if "o_proj" in parts or "down_proj" in parts:  # row-parallel: the bias is added once
            if name.endswith(".bias"):
                return t if rank0 else torch.zeros_like(t)
            if "o_proj" in parts:  # narrow_in: also a quantized weight's packed columns
                full = self.config.num_attention_heads * d
                return narrow_in(t, hs.q_start * d, hs.q_count * d, full)
            inter = mlp.inter_end - mlp.inter_start
            return narrow_in(t, mlp.inter_start, inter, self.config.intermediate_size)
        if name == "lm_head.weight":
            rows = t[self.vocab_start : min(self.vocab_end, t.shape[0])]
            pad = self.vocab_end - self.vocab_start - rows.shape[0]
            return torch.cat([rows, rows.new_zeros(pad, rows.shape[1])]) if pad else rows
        return t

    def _shard_sizes(self, target: str) -> list[int]:
        if "qkv_proj" in target:
            return list(self.layers[0].self_attn.sizes)
        mlp = self.layers[0].mlp
        inter = mlp.inter_end - mlp.inter_start
        return [inter, inter]

    def expected_weights(self) -> set[str]:
        names = set()
        for name, _ in self.named_parameters():
            if "qkv_proj" in name:
                names |= {f"{name}#{i}" for i in range(3)}
            elif "gate_up_proj" in name:
                names |= {f"{name}#{i}" for i in range(2)}
            else:
                names.add(name)
        return names
