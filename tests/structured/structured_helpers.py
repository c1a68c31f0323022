"""What the structured-output tests share: the schema corpus, a tiny random model with
SmolLM2's vocabulary, jsonschema with format checks, xgrammar as an outside oracle."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tiny_hf import spread_weights

SCHEMAS = json.loads((Path(__file__).parent / "schemas.json").read_text())


def make_tiny_smol(path: str, seed: int = 0) -> str:
    """A tiny random Llama with the default model's tokenizer; its logits have 64 ids more
    than the tokenizer (padding ids the masks must exclude)."""
    import transformers as tf

    from paged.model.loader import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(None))
    cfg = tf.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(tok) + 64,  # the logits' vocabulary exceeds the tokenizer's
        max_position_embeddings=1024,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
    )
    torch.manual_seed(seed)
    model = tf.LlamaForCausalLM(cfg).eval()
    spread_weights(model)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


def format_checked(schema: dict, value) -> None:
    """jsonschema validation with the format checks jsonschema has (date, email, ipv4, uuid)."""
    import jsonschema

    cls = jsonschema.validators.validator_for(schema)
    cls(schema, format_checker=cls.FORMAT_CHECKER).validate(value)


class GrammarOracle:
    """xgrammar outside the engine: is a token sequence a (complete) sentence of a grammar?"""

    def __init__(self, tokenizer, vocab_size: int, eos: int) -> None:
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=[eos]
        )
        self.compiler = xgr.GrammarCompiler(info)

    def accepts(self, compiled, token_ids: list[int]) -> tuple[bool, bool]:
        """(every token accepted, the grammar terminated)."""
        import xgrammar as xgr

        m = xgr.GrammarMatcher(compiled)
        ok = all(m.accept_token(t) for t in token_ids)
        return ok, m.is_terminated()
