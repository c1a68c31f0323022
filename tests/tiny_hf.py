"""Tiny random HF models saved locally: the shape every test model starts from (conftest.py's
fixtures, and tests that need a variant of it)."""

from __future__ import annotations

import torch

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=320,
    max_position_embeddings=512,
)


def make_tiny(kind: str, path: str, seed: int = 0, **changes) -> str:
    """Save a tiny random HF model of `kind` (llama | qwen2 | mistral) to `path`; `changes`
    override TINY's sizes (e.g. num_hidden_layers)."""
    import transformers as tf

    cfg_cls, model_cls = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
    }[kind]
    extra = {"tie_word_embeddings": kind == "qwen2"}
    if kind == "mistral":
        extra["sliding_window"] = None
    cfg = cfg_cls(**{**TINY, **changes}, **extra, eos_token_id=1, bos_token_id=0)
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    spread_weights(model)
    model.save_pretrained(path, safe_serialization=True)
    return path


def llama_with_tokenizer(path: str, tok) -> str:
    """A tiny random Llama (TINY's sizes, seed 0, torch's initial weights) over `tok`'s
    vocabulary, saved with `tok` (e.g. the default model's tokenizer and chat template)."""
    import transformers as tf

    cfg = tf.LlamaConfig(**{**TINY, "vocab_size": len(tok)}, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    tf.LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


def spread_weights(model: torch.nn.Module) -> None:
    """Every matrix drawn again from N(0, 0.2) (torch's global generator): a freshly
    initialised model's weights are small and its logits flat; larger ones keep greedy
    decoding far from ties."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
