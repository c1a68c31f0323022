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


def _forced(smollm, text: str, **kw):
    """The default model's greedy output with every step forced to `text`'s one token."""
    from paged import SamplingParams

    (tok,) = smollm.tokenizer(text, add_special_tokens=False).input_ids
    params = SamplingParams(temperature=0, max_tokens=8, logit_bias={tok: 100}, **kw)
    return tok, smollm.generate("Fruits:", params, use_tqdm=False)[0].outputs[0]


def test_stop_strings_wait_for_min_tokens(smollm):
    """As vLLM: a stop string ends nothing among the first min_tokens tokens."""
    tok, out = _forced(smollm, " banana", stop=["banana"], min_tokens=5)
    assert out.token_ids == [tok] * 6 and out.text == " banana" * 5 + " "
    assert (out.finish_reason, out.stop_reason) == ("stop", "banana")
    _, out = _forced(smollm, " banana", stop=["banana"])
    assert out.text == " " and len(out.token_ids) == 1


@pytest.mark.parametrize("include", [False, True])
def test_the_token_that_ends_a_sequence_leaves_the_text(smollm, include):
    """A stop token id, or EOS shown with skip_special_tokens=False, stays in token_ids but
    not in the text unless include_stop_str_in_output (as vLLM)."""
    tok, out = _forced(smollm, " banana", stop_token_ids=[smollm.tokenizer(" banana").input_ids[0]],
                       include_stop_str_in_output=include)  # fmt: skip
    assert out.token_ids == [tok] and out.stop_reason == tok
    assert out.text == (" banana" if include else "")
    tok, out = _forced(smollm, "<|im_end|>", skip_special_tokens=False, min_tokens=0,
                       include_stop_str_in_output=include)  # fmt: skip
    assert out.token_ids == [tok] and out.finish_reason == "stop"
    assert out.text == ("<|im_end|>" if include else "")


def test_logprob_bytes_are_the_tokens_own(smollm):
    """OpenAI's `bytes` of a token that is part of a character: its own bytes, so a client
    joining them gets the text back (the decoded piece alone shows U+FFFD)."""
    from paged.server.logprobs import chat_logprobs, token_bytes

    tok = smollm.tokenizer
    text = "🎉 Kraków 日本"
    ids = tok(text, add_special_tokens=False).input_ids
    assert any(tok.decode([i]) == "\ufffd" for i in ids)  # pieces of characters
    assert bytes(b for i in ids for b in token_bytes(tok, i)).decode() == text
    content = chat_logprobs(tok, 1, ids, [{i: -0.5} for i in ids])["content"]
    assert bytes(b for e in content for b in e["bytes"]).decode() == text
    assert content[0]["top_logprobs"][0]["bytes"] == token_bytes(tok, ids[0])
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    assert token_bytes(tok, eos) == list(b"<|im_end|>")


@pytest.mark.parametrize("include", [False, True])
def test_a_beam_ended_by_eos_leaves_it_out_of_the_text(smollm, include):
    from types import SimpleNamespace

    from paged.server.beam import _text

    tok = smollm.tokenizer
    ids = tok("Hi there", add_special_tokens=False).input_ids
    seq = SimpleNamespace(tokens=[5, *ids, tok.convert_tokens_to_ids("<|im_end|>")],
                          finish_reason="stop")  # fmt: skip
    req = SimpleNamespace(include_stop_str_in_output=include, skip_special_tokens=False)
    got = _text(SimpleNamespace(tokenizer=tok), seq, 1, req)
    assert got == ("Hi there<|im_end|>" if include else "Hi there")
