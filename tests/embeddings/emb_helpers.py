"""Embedding test helpers: tiny tokenizer, sentence-transformers files, HF reference pooling."""

from __future__ import annotations

import json
from pathlib import Path

import tiny_hf
import torch

TINY = {**tiny_hf.TINY, "max_position_embeddings": 256, "bos_token_id": 0, "eos_token_id": 1}
TEXT = ["the quick brown fox jumps over the lazy dog", "paged attention keeps blocks"]


def save_tokenizer(path: str, vocab_size: int) -> None:
    """A byte-level BPE trained offline on a few sentences; <s>=0, </s>=1."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TEXT * 20, trainer)
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>"
    ).save_pretrained(path)


def save_sentence_transformers(path: str, mode: str, normalize: bool) -> None:
    """modules.json and 1_Pooling/config.json as sentence-transformers writes them."""
    root = Path(path)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})  # fmt: skip
        (root / "2_Normalize").mkdir(exist_ok=True)
    (root / "modules.json").write_text(json.dumps(modules))
    (root / "1_Pooling").mkdir(exist_ok=True)
    pool = {"word_embedding_dimension": TINY["hidden_size"], "include_prompt": True}
    for m in ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "lasttoken"):
        pool[f"pooling_mode_{m}"] = m == mode
    (root / "1_Pooling" / "config.json").write_text(json.dumps(pool))


def hf_pooled(
    path: str, prompts: list[list[int]], kind: str, normalize: bool
) -> list[torch.Tensor]:
    """HF AutoModel's final hidden states pooled: LAST | MEAN | CLS, float32."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            h = model(torch.tensor([ids])).last_hidden_state[0].float()
            v = {"LAST": h[-1], "MEAN": h.mean(0), "CLS": h[0]}[kind]
            out.append(torch.nn.functional.normalize(v, dim=-1) if normalize else v)
    return out


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, TINY["vocab_size"], (n,), generator=g).tolist() for n in lengths]
