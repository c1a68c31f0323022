"""Structured outputs through LLM() on a tiny random model with SmolLM2's vocabulary: its
generations are garbage, which stresses the mask (every token the grammar allows is fair)."""

from __future__ import annotations

import json

import pytest
from structured_helpers import SCHEMAS, GrammarOracle, format_checked

from paged import LLM
from paged.sampling.params import SamplingParams, StructuredOutputsParams

PROMPT = "Reply with JSON:"


@pytest.fixture(scope="module")
def llm(tiny_smol):
    return LLM(tiny_smol, dtype="float32", max_model_len=512, kv_cache_memory="32MiB")


@pytest.fixture(scope="module")
def oracle(llm):
    return GrammarOracle(llm.tokenizer, llm.engine.vocab_size, llm.engine.eos_token_ids[0])


def so(**kw) -> SamplingParams:
    max_tokens = kw.pop("max_tokens", 64)
    return SamplingParams(
        temperature=0, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(**kw)
    )


def no_leak(llm) -> None:
    assert len(llm.engine.structured) == 0  # every matcher freed
    llm.engine.kv.check_invariants()
    assert llm.engine.kv.num_free_blocks == llm.engine.num_blocks


def test_json_schema_corpus(llm, oracle):
    """Every schema of the corpus, batched: complete outputs parse and validate; the few cut
    by max_tokens are a valid prefix of the schema's language."""
    params = [so(json=c["schema"], disable_any_whitespace=True, max_tokens=96) for c in SCHEMAS]
    outs = llm.generate([PROMPT] * len(SCHEMAS), params, use_tqdm=False)
    complete = 0
    vocab = len(llm.tokenizer)
    for c, o in zip(SCHEMAS, outs):
        out = o.outputs[0]
        assert max(out.token_ids) < vocab, c["name"]  # never a padding id of the logits
        if out.finish_reason == "stop":
            format_checked(c["schema"], json.loads(out.text))
            complete += 1
        else:
            assert out.finish_reason == "length", c["name"]
            compiled = oracle.compiler.compile_json_schema(
                json.dumps(c["schema"]), any_whitespace=False
            )
            ok, done = oracle.accepts(compiled, out.token_ids)
            assert ok and not done, c["name"]
    assert complete >= len(SCHEMAS) - 8  # most schemas bound their outputs: they end
    no_leak(llm)


def test_regex_choice_grammar_json_object(llm, oracle):
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    params = [
        so(regex=r"[a-z]{2,5}@[a-z]{3}\.(com|org)"),
        so(choice=["alpha", "beta", "gamma delta"]),
        so(grammar=grammar, max_tokens=24),
        so(json_object=True, max_tokens=48),
    ]
    outs = [o.outputs[0] for o in llm.generate([PROMPT] * 4, params, use_tqdm=False)]
    import re

    assert outs[0].finish_reason == "stop"
    assert re.fullmatch(r"[a-z]{2,5}@[a-z]{3}\.(com|org)", outs[0].text)
    assert outs[1].finish_reason == "stop" and outs[1].text in ("alpha", "beta", "gamma delta")
    ok, _ = oracle.accepts(oracle.compiler.compile_grammar(grammar), outs[2].token_ids)
    assert ok
    if outs[2].finish_reason == "stop":
        assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", outs[2].text)
    json_any = oracle.compiler.compile_json_schema('{"type": "object"}')
    ok, done = oracle.accepts(json_any, outs[3].token_ids)
    assert ok and outs[3].text.lstrip().startswith("{")
    if outs[3].finish_reason == "stop":
        assert isinstance(json.loads(outs[3].text), dict)
    no_leak(llm)


def test_unconstrained_neighbours_unchanged(llm):
    """Greedy requests give the same tokens whether or not constrained ones share their
    steps (the mask touches only the constrained rows)."""
    prompts = ["The weather today", "Once upon a time", "1, 2, 3,"]
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, plain, use_tqdm=False)]
    mixed_prompts = [prompts[0], PROMPT, prompts[1], PROMPT, prompts[2]]
    mixed_params = [plain, so(json=SCHEMAS[0]["schema"]), plain, so(regex="[0-9]{6}"), plain]
    mixed = llm.generate(mixed_prompts, mixed_params, use_tqdm=False)
    assert [mixed[i].outputs[0].token_ids for i in (0, 2, 4)] == alone
    no_leak(llm)


def test_allowed_token_ids(llm):
    allowed = llm.tokenizer(" yes no maybe", add_special_tokens=False).input_ids + [100, 2000]
    p = SamplingParams(temperature=0.9, seed=3, max_tokens=16, allowed_token_ids=allowed)
    out = llm.generate([PROMPT], p, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 16 and set(out.token_ids) <= set(allowed)
    no_leak(llm)


def test_bad_words(llm):
    tok = llm.tokenizer
    p = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    before = llm.generate(["Once upon a time"], p, use_tqdm=False)[0].outputs[0].token_ids
    # A word that is one token of the output, alone and after a space.
    word = next(
        w
        for t in before
        if (w := tok.decode([t]).strip()).isalpha()
        and tok.encode(w, add_special_tokens=False) == [t]
        or tok.encode(" " + w, add_special_tokens=False) == [t]  # fmt: skip
    )
    banned = {tuple(tok.encode(s + word, add_special_tokens=False)) for s in ("", " ")}
    banned = {b[0] for b in banned if len(b) == 1}
    assert banned & set(before)
    bad = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, bad_words=[word])
    after = llm.generate(["Once upon a time"], bad, use_tqdm=False)[0].outputs[0].token_ids
    assert not banned & set(after)
    assert after != before
    no_leak(llm)


def test_invalid_specs_name_the_field(llm):
    with pytest.raises(ValueError, match=r"^structured_outputs\.regex: invalid regex"):
        llm.generate([PROMPT], so(regex="a(b"), use_tqdm=False)
    with pytest.raises(ValueError, match=r"^structured_outputs\.json: invalid JSON schema"):
        llm.generate([PROMPT], so(json={"type": "bogus"}), use_tqdm=False)
    with pytest.raises(ValueError, match=r"^structured_outputs\.json: at the root: 'multipleOf'"):
        llm.generate([PROMPT], so(json={"type": "number", "multipleOf": 0.1}), use_tqdm=False)
    with pytest.raises(ValueError, match=r"^structured_outputs\.grammar: invalid EBNF"):
        llm.generate([PROMPT], so(grammar="root ::= "), use_tqdm=False)
    with pytest.raises(ValueError, match=r"^structured_outputs: exactly one of"):
        StructuredOutputsParams(regex="a", choice=["a"])
    for kw in ({"min_tokens": 2}, {"ignore_eos": True}):  # the grammar ends the output
        with pytest.raises(ValueError, match=f"^{next(iter(kw))}: cannot be combined with a s"):
            SamplingParams(structured_outputs=StructuredOutputsParams(choice=["a"]), **kw)
    with pytest.raises(ValueError, match=r"^allowed_token_ids: token id 999999"):
        llm.generate([PROMPT], SamplingParams(allowed_token_ids=[999999]), use_tqdm=False)
    no_leak(llm)
    # The engine goes on.
    assert llm.generate([PROMPT], so(choice=["ok"]), use_tqdm=False)[0].outputs[0].text == "ok"


def test_n_samples_each_constrained(llm):
    p = SamplingParams(
        n=3,
        temperature=1.0,
        seed=7,
        max_tokens=64,
        structured_outputs=StructuredOutputsParams(json=SCHEMAS[0]["schema"]),
    )
    outs = llm.generate([PROMPT], p, use_tqdm=False)[0].outputs
    assert len(outs) == 3
    for out in outs:
        if out.finish_reason == "stop":
            format_checked(SCHEMAS[0]["schema"], json.loads(out.text))
    no_leak(llm)


def test_preemption_keeps_matchers_and_stop_strings_free_them(tiny_smol, llm):
    """With too few KV blocks requests are preempted and recomputed: each keeps its matcher
    (tokens already accepted are not accepted again), so outputs equal the roomy run's."""
    names = ("tags", "ref_defs", "matrix", "recipe", "order", "weather", "event", "tree")
    chosen = [c for c in SCHEMAS if c["name"] in names]
    params = [so(json=c["schema"], disable_any_whitespace=True, max_tokens=64) for c in chosen]
    prompts = [f"{PROMPT} {c['prompt']}" for c in chosen]
    roomy = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    tight = LLM(tiny_smol, dtype="float32", max_model_len=128, num_kv_blocks=10, block_size=16)
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == roomy
    no_leak(tight)
    # A stop string ends a constrained request from outside the engine: its matcher goes.
    p = SamplingParams(
        temperature=0,
        max_tokens=64,
        stop=['"'],
        structured_outputs=StructuredOutputsParams(
            json=chosen[0]["schema"], disable_any_whitespace=True
        ),
    )
    out = tight.generate([PROMPT], p, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.text == "{"
    no_leak(tight)


def test_compile_failure_in_the_core_rejects_the_request(llm, monkeypatch):
    """A spec that parses but fails to compile in the core's pool: the request is rejected
    with the field named, others are unaffected, nothing leaks."""

    def boom(sp):
        raise RuntimeError("[12:00:00] /x/compiler.cc:1: out of grammar budget")

    monkeypatch.setattr(llm.engine.structured, "_compile", boom)
    with pytest.raises(RuntimeError, match=r"structured_outputs\.regex: out of grammar budget"):
        llm.generate([PROMPT], so(regex="[0-9]+"), use_tqdm=False)
    no_leak(llm)
    monkeypatch.undo()
    assert llm.generate([PROMPT], so(choice=["ok"]), use_tqdm=False)[0].outputs[0].text == "ok"


def test_compiling_request_waits_without_stalling_others_and_aborts_cleanly(llm, monkeypatch):
    """While a grammar compiles, the request is not scheduled and the others run; aborted
    while compiling, it leaves nothing behind."""
    import threading

    from paged.engine.core import EngineCore

    engine: EngineCore = llm.engine
    release = threading.Event()
    compile_ = engine.structured._compile

    def held(sp):
        release.wait(60)
        return compile_(sp)

    monkeypatch.setattr(engine.structured, "_compile", held)
    ids = llm.tokenizer(PROMPT).input_ids
    engine.add_request("held", ids, so(regex="[0-9]{4}"))
    engine.add_request("aborted", ids, so(regex="[a-z]{4}"))
    engine.add_request("plain", ids, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    engine.abort(["aborted"])
    done: dict[str, list[int]] = {"held": [], "plain": [], "aborted": []}
    finished = set()
    while "plain" not in finished:
        for eo in engine.step():
            done[eo.request_id] += eo.new_token_ids
            if eo.finished:
                finished.add(eo.request_id)
    assert len(done["plain"]) == 4 and not done["held"] and "held" in engine.structured.pending
    release.set()
    while engine.has_unfinished():
        for eo in engine.step():
            done[eo.request_id] += eo.new_token_ids
    assert len(done["held"]) == 5 and not done["aborted"]  # four digits, then end of sequence
    assert llm.tokenizer.decode(done["held"][:4]).isdigit()
    no_leak(llm)
