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


def shape_config(name: str):
    """A transformers LlamaConfig for a named shape."""
    from transformers import LlamaConfig

    if name.lower() not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; known: {', '.join(SHAPES)}")
    cfg = LlamaConfig(**SHAPES[name.lower()])
    cfg.architectures = ["LlamaForCausalLM"]
    return cfg
