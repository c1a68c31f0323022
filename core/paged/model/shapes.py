"""Named model shapes for ``--load-format dummy`` benchmarks (no weights needed)."""

from __future__ import annotations

SHAPES: dict[str, dict] = {
    "llama-3.1-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        bos_token_id=128000,
        eos_token_id=[128001, 128008, 128009],
    ),
    "llama-3.2-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        bos_token_id=128000,
        eos_token_id=[128001, 128008, 128009],
    ),
    # Qwen3 shapes (model/qwen3.py): the dense 8B and the 30B mixture of experts (3B active)
    "qwen3-8b": dict(
        architecture="Qwen3ForCausalLM",
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
        bos_token_id=151643,
        eos_token_id=151645,
    ),
    "qwen3-30b-a3b": dict(
        architecture="Qwen3MoeForCausalLM",
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
        bos_token_id=151643,
        eos_token_id=151645,
    ),
    # Gemma 3 12B (text): 5 sliding-window layers (1024) to 1 global, head 256, 262k vocab
    "gemma-3-12b": dict(
        architecture="Gemma3ForCausalLM",
        hidden_size=3840,
        intermediate_size=15360,
        num_hidden_layers=48,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=256,
        vocab_size=262208,
        max_position_embeddings=131072,
        rms_norm_eps=1e-6,
        sliding_window=1024,
        layer_types=[
            "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(48)
        ],
        query_pre_attn_scalar=256,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        },
        bos_token_id=2,
        eos_token_id=[1, 106],
    ),
    # Phi-4-mini: fused QKV and gate-up, 3/4 of each head rotated, LongRoPE, 200k vocab
    "phi-4-mini": dict(
        architecture="Phi3ForCausalLM",
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=32,
        num_attention_heads=24,
        num_key_value_heads=8,
        vocab_size=200064,
        max_position_embeddings=131072,
        original_max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        partial_rotary_factor=0.75,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": 4096,
            "short_factor": [1.0 + 0.01 * i for i in range(48)],
            "long_factor": [1.0 + 0.5 * i for i in range(48)],
        },
        bos_token_id=199999,
        eos_token_id=[200020, 199999],
        pad_token_id=199999,
    ),
    "smollm2-135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        rope_theta=100000.0,
        bos_token_id=1,
        eos_token_id=2,
    ),
}
# Llama-3.1-70B: the 8B's vocabulary, rope and token ids, wider and deeper
SHAPES["llama-3.1-70b"] = dict(SHAPES["llama-3.1-8b"], hidden_size=8192, intermediate_size=28672,
                               num_hidden_layers=80, num_attention_heads=64)  # fmt: skip


_CONFIGS = {
    "LlamaForCausalLM": "LlamaConfig",
    "Qwen3ForCausalLM": "Qwen3Config",
    "Qwen3MoeForCausalLM": "Qwen3MoeConfig",
    "Gemma3ForCausalLM": "Gemma3TextConfig",
    "Phi3ForCausalLM": "Phi3Config",
}


def shape_config(name: str):
    """The transformers config for a named shape (a LlamaConfig unless it names another
    architecture)."""
    import transformers

    if name.lower() not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; known: {', '.join(SHAPES)}")
    spec = dict(SHAPES[name.lower()])
    arch = spec.pop("architecture", "LlamaForCausalLM")
    cfg = getattr(transformers, _CONFIGS[arch])(**spec)
    cfg.architectures = [arch]
    return cfg
