"""Incremental detokenization: the deltas add up to the whole text's decode, through the fast
tokenizer's Rust backend and through transformers' decode alike."""

from __future__ import annotations

import pytest

from paged.engine.detokenizer import IncrementalDetokenizer

TEXT = 'Sure! {"name": "Zoë", "city": "Kraków"} 日本語 — done.\n  Next line:\tok'


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("path", ["backend", "transformers"])
def test_deltas_add_up_to_the_decode(smollm, skip, path, monkeypatch):
    tok = smollm.tokenizer
    if path == "transformers":  # a tokenizer that cleans up spaces: transformers' decode
        monkeypatch.setattr(tok, "clean_up_tokenization_spaces", None, raising=False)
    prompt = tok("Reply:").input_ids
    ids = tok(TEXT, add_special_tokens=False).input_ids + [tok.eos_token_id]
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    assert (detok.decode.func == tok.backend_tokenizer.decode) == (path == "backend")
    text = "".join(detok.add([t]) for t in ids)
    assert text == tok.decode(prompt + ids, skip_special_tokens=skip)[len(tok.decode(prompt)) :]
