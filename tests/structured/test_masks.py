"""The mask pieces without a model: bad-word tokenization and masking, allowed ids, the
bitmask ops against xgrammar's reference, the backend flag."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from paged.model import ops
from paged.sampling.params import SamplingParams
from paged.sampling.structured import (
    RequestMask,
    StructuredOutputs,
    bad_words_ids,
    check_backend,
    pack_allowed,
)


class WordTokenizer:
    """Tokens: words, with a leading space a different token ("Ġ" style)."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        out = []
        for i, w in enumerate(text.split(" ")):
            if w:
                key = (" " if i or text.startswith(" ") else "") + w
                out.append(self.vocab.setdefault(key, len(self.vocab)))
        return out


def test_bad_words_tokenized_alone_and_after_a_space():
    tok = WordTokenizer()
    ids = bad_words_ids(tok, ["very bad", "evil"])
    v = tok.vocab
    assert ids == [[v["very"], v[" bad"]], [v[" very"], v[" bad"]], [v["evil"]], [v[" evil"]]]


class FakeRequest:
    def __init__(self, rid: str, out: list[int], params: SamplingParams | None = None) -> None:
        self.request_id = rid
        self.params = params or SamplingParams()
        self.token_ids = [0, *out]
        self.num_computed_tokens = len(self.token_ids) - 1
        self.num_tokens = len(self.token_ids)
        self.output_token_ids = out
        self.finished = False


class FakeBatch:
    def __init__(self, reqs: list[FakeRequest]) -> None:
        self.reqs = reqs
        self.num_new = [1] * len(reqs)
        self.forks = []


def allowed_ids(bm: torch.Tensor, row: int, vocab: int) -> set[int]:
    words = bm[row].numpy().view(np.uint32)
    return {t for t in range(vocab) if words[t >> 5] >> (t & 31) & 1}


def test_bitmask_bad_words_and_allowed_ids():
    vocab = 100
    so = StructuredOutputs(lambda: None, vocab, (1,))
    so.masks["a"] = RequestMask(bad_words=[[5, 7], [9]])
    so.masks["b"] = RequestMask(allowed=pack_allowed([3, 40, 99], vocab), bad_words=[[40]])
    so.masks["c"] = RequestMask(bad_words=[[5, 7]])
    batch = FakeBatch([FakeRequest("a", [2, 5]), FakeRequest("plain", [1]),
                       FakeRequest("b", []), FakeRequest("c", [5, 6])])  # fmt: skip
    rows, bm = so.bitmask(batch)
    assert set(rows) == {"a", "b", "c"}
    # "a" ends with 5: 7 would complete [5, 7]; 9 is always banned.
    assert set(range(vocab)) - allowed_ids(bm, rows["a"], vocab) == {7, 9}
    assert allowed_ids(bm, rows["b"], vocab) == {3, 99}
    assert allowed_ids(bm, rows["c"], vocab) == set(range(vocab))  # 6 breaks the sequence


@pytest.mark.parametrize("rows", [None, [1, 3, 4]])
def test_apply_token_bitmask_matches_xgrammar(rows):
    """The default op (a lookup table of 0 / -inf added per byte) against xgrammar's own."""
    import xgrammar as xgr

    vocab, n = 1000, 5  # 1000 is not a multiple of 32: the last word is partial
    k = n if rows is None else len(rows)
    gen = torch.Generator().manual_seed(0)
    bm = torch.randint(-(2**31), 2**31 - 1, (k, (vocab + 31) // 32), dtype=torch.int32,
                       generator=gen)  # fmt: skip
    logits = torch.randn(n, vocab, generator=gen)
    want = logits.clone()
    if rows is None:
        xgr.apply_token_bitmask_inplace(want, bm, backend="torch_native")
    else:  # xgrammar's indices pick rows of both tensors
        full = torch.full((n, bm.shape[1]), -1, dtype=torch.int32)
        full[rows] = bm
        xgr.apply_token_bitmask_inplace(want, full, indices=rows, backend="torch_native")
    t_rows = None if rows is None else torch.tensor(rows)
    got = logits.clone()
    ops.apply_token_bitmask(got, bm, t_rows)
    assert torch.equal(got, want)


def test_backend_flag():
    assert check_backend("auto") == check_backend("xgrammar") == "xgrammar"
    with pytest.raises(ValueError, match="structured_outputs_backend: 'outlines' is not one of"):
        check_backend("outlines")
    with pytest.raises(ValueError, match="structured_outputs_backend: llguidance"):
        check_backend("llguidance")
    from paged.config import EngineConfig

    with pytest.raises(ValueError, match="structured_outputs_backend"):
        EngineConfig(structured_outputs_backend="nope")


def test_a_known_grammar_is_ready_at_once_a_new_one_compiles_in_the_pool(tiny_smol):
    """A batch of requests with one schema: the first compiles in the pool, the rest (and
    allowed-id lists) are ready when added, so the next step schedules all of them."""
    from transformers import AutoTokenizer

    from paged.sampling.params import StructuredOutputsParams

    tok = AutoTokenizer.from_pretrained(tiny_smol)
    so = StructuredOutputs(lambda: tok, len(tok), (tok.eos_token_id,))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

    def add(rid: str, **kw) -> None:
        so.add([FakeRequest(rid, [], SamplingParams(**kw))])

    add("first", structured_outputs=StructuredOutputsParams(json=schema))
    assert so._pool is not None  # compiling: off the step loop
    so.pending["first"][1].result(timeout=60)
    add("same", structured_outputs=StructuredOutputsParams(json=dict(schema)))
    add("ids", allowed_token_ids=[3, 4])
    assert so.pending["same"][1].done() and so.pending["ids"][1].done()
    add("other", structured_outputs=StructuredOutputsParams(regex="[0-9]+"))
    ready, failed = so.ready(timeout=60)
    while so.pending:
        more, bad = so.ready(timeout=60)
        ready, failed = ready + more, failed + bad
    assert not failed
    assert sorted(s[0].request_id for s in ready) == ["first", "ids", "other", "same"]
    assert so.masks["same"].matcher is not None and so.masks["ids"].matcher is None


def test_json_object_is_an_object_and_compact_when_asked(tiny_smol):
    """json_object compiles the schema {"type": "object"} (OpenAI's JSON mode, vLLM's
    xgrammar backend): never an array or a scalar; disable_any_whitespace leaves only the
    ", " and ": " separators."""
    from transformers import AutoTokenizer
    from xgrammar.testing import _is_grammar_accept_string

    from paged.sampling.params import StructuredOutputsParams

    tok = AutoTokenizer.from_pretrained(tiny_smol)
    so = StructuredOutputs(lambda: tok, len(tok), (tok.eos_token_id,))
    so._tok()

    def accepts(compact: bool) -> list[bool]:
        sp = StructuredOutputsParams(json_object=True, disable_any_whitespace=compact)
        grammar = so._compile(sp).grammar
        texts = ('{"a": 1}', '{"a": [1, {"b": null}]}', "[1]", "1", '{ "a" : 1 }', '{"a":1}')
        return [_is_grammar_accept_string(grammar, t) for t in texts]

    assert accepts(False) == [True, True, False, False, True, True]
    assert accepts(True) == [True, True, False, False, False, False]
