"""Grammar-constrained requests in overlapped steps (the next step's forward is queued before
this step's tokens are resolved; the matchers take the token in flight early), and grammars
against min_tokens (refused)."""

from __future__ import annotations

import json

import pytest
from structured_helpers import SCHEMAS

from paged import LLM
from paged.sampling.params import SamplingParams, StructuredOutputsParams

PROMPT = "Reply with JSON:"


def so(max_tokens: int = 48, **kw) -> SamplingParams:
    return SamplingParams(
        temperature=0, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(**kw)
    )


def make(path: str, overlap: bool) -> LLM:
    return LLM(path, dtype="float32", max_model_len=512, kv_cache_memory="32MiB",
               async_scheduling=overlap)  # fmt: skip


@pytest.fixture(scope="module")
def overlapped(tiny_smol):
    return make(tiny_smol, True)


def batch() -> tuple[list[str], list[SamplingParams]]:
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    params = [so(json=c["schema"], disable_any_whitespace=True) for c in SCHEMAS[:6]]
    params += [so(regex="[0-9]{3}-[a-z]{2,4}"), so(choice=["yes", "no", "maybe"]), plain]
    any_json = StructuredOutputsParams(json_object=True)
    sampled = SamplingParams(temperature=1.0, seed=7, max_tokens=40, structured_outputs=any_json)
    params.append(sampled)
    return [PROMPT] * (len(params) - 2) + ["Once upon a time", PROMPT], params


def test_overlapped_masked_steps_equal_sequential(tiny_smol, overlapped):
    prompts, params = batch()
    ref = make(tiny_smol, False)
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
    engine = overlapped.engine
    assert engine.runner.overlap and engine._can_overlap()
    fills = []  # masks filled in the engine's thread, beside the resolve of the step in flight
    fill_beside = engine._fill_beside
    engine._fill_beside = lambda *a: fills.append(1) or fill_beside(*a)
    try:
        got = [o.outputs[0].token_ids
               for o in overlapped.generate(prompts, params, use_tqdm=False)]  # fmt: skip
    finally:
        del engine._fill_beside
    assert got == want and len(fills) >= 10
    for o, p in zip(want, params):  # the constrained ones end in their language
        if p.structured_outputs is not None and p.structured_outputs.json is not None:
            text = overlapped.tokenizer.decode(o, skip_special_tokens=True)
            if len(o) < p.max_tokens:
                json.loads(text)
    assert len(engine.structured) == 0
    engine.kv.check_invariants()
    assert engine.kv.num_free_blocks == engine.num_blocks


def test_steps_stay_overlapped_while_masked_requests_run(overlapped):
    """A masked request no longer forces the step loop to wait for each step's tokens."""
    engine = overlapped.engine
    engine.add_request("m", overlapped.tokenizer(PROMPT).input_ids, so(regex="[a-z]{30}"))
    overlapped_steps, tokens = 0, 0
    while engine.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
        overlapped_steps += engine.inflight is not None
    assert tokens >= 5 and overlapped_steps >= tokens - 1  # each step but the last


def test_min_tokens_and_ignore_eos_are_refused_beside_a_grammar(overlapped):
    """A grammar ends the output once complete (it allows only the end): neither min_tokens
    nor ignore_eos could be honoured, so both are refused, also when set on params after
    they were validated (the engine validates again)."""
    grammar = StructuredOutputsParams(choice=["a"])
    for field, value in (("min_tokens", 2), ("ignore_eos", True)):
        with pytest.raises(ValueError, match=f"^{field}: cannot be combined with a structured"):
            SamplingParams(structured_outputs=grammar, **{field: value})
        p = so(choice=["yes", "no"], max_tokens=32)
        setattr(p, field, value)
        with pytest.raises(ValueError, match=f"^{field}: cannot be combined with a structured"):
            overlapped.generate([PROMPT], p, use_tqdm=False)
    assert len(overlapped.engine.structured) == 0 and not overlapped.engine.has_unfinished()


def test_a_failed_mask_fill_fails_its_step_only(overlapped, monkeypatch):
    """The mask thread fills and queues a step's sampling; an error there fails that step's
    requests (reported, blocks freed) and the engine goes on."""
    from paged.sampling import structured

    engine = overlapped.engine
    ids = overlapped.tokenizer(PROMPT).input_ids
    grammar, calls = structured.MaskFill.grammar, []

    def broken(self):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("fill broke")
        return grammar(self)

    monkeypatch.setattr(structured.MaskFill, "grammar", broken)
    engine.add_request("m", ids, so(regex="[a-z]{30}"))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [o.error for o in outs if o.error] == ["RuntimeError: fill broke"]
    assert outs[-1].finished and len(calls) == 3
    monkeypatch.setattr(structured.MaskFill, "grammar", grammar)
    engine.kv.check_invariants()
    assert engine.kv.num_free_blocks == engine.num_blocks and len(engine.structured) == 0
    out = overlapped.generate([PROMPT], so(regex="[a-z]{8}"), use_tqdm=False)[0].outputs[0]
    assert len(out.text) == 8 and out.text.isalpha()
