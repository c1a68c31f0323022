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


_CONFIGS = {
    "LlamaForCausalLM": "LlamaConfig",
    "Qwen3ForCausalLM": "Qwen3Config",
    "Qwen3MoeForCausalLM": "Qwen3MoeConfig",
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
