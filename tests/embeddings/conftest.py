"""Embedding fixtures: a tiny random Qwen3 saved as Qwen3-Embedding is (a bare Qwen3Model with
sentence-transformers files) and a tiny Llama with its LM head, each with a tiny tokenizer."""

from __future__ import annotations

import pytest
import torch
from emb_helpers import TINY, save_sentence_transformers, save_tokenizer
from tiny_hf import spread_weights


@pytest.fixture(scope="session")
def qwen3_embedding(tmp_path_factory) -> str:
    """Qwen3-Embedding's layout: Qwen3Model weights (no `model.` prefix, no lm_head), untied,
    Matryoshka declared, last-token pooling and Normalize in sentence-transformers files."""
    from transformers import Qwen3Config, Qwen3Model

    path = str(tmp_path_factory.mktemp("emb") / "qwen3-embedding")
    cfg = Qwen3Config(**TINY, head_dim=16, tie_word_embeddings=False, is_matryoshka=True)
    torch.manual_seed(0)
    model = Qwen3Model(cfg).eval()
    spread_weights(model)
    model.save_pretrained(path, safe_serialization=True)
    save_sentence_transformers(path, "lasttoken", normalize=True)
    save_tokenizer(path, TINY["vocab_size"])
    return path


@pytest.fixture(scope="session")
def llama_lm(tmp_path_factory) -> str:
    """A tiny Llama with its LM head: runs for generation, embeddings on request."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = str(tmp_path_factory.mktemp("emb") / "llama")
    torch.manual_seed(1)
    model = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    spread_weights(model)
    model.save_pretrained(path, safe_serialization=True)
    save_tokenizer(path, TINY["vocab_size"])
    return path
