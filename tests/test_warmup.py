"""Start-up warm-up (paged.engine.warmup): the step shapes it runs, and an engine left as new."""

from __future__ import annotations

import pytest

import paged.engine.core as core_mod
from paged import LLM, SamplingParams
from paged.engine.warmup import warm_up

BUDGET = 64
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 9, 13, 200, 7, 7, 31], list(range(40, 140))]


def launched_steps(engine) -> list[list[tuple[int, int, int]]]:
    """Record each launched step as (computed before, new tokens, prompt length) per row."""
    steps: list[list[tuple[int, int, int]]] = []
    launch = engine.executor.launch

    def spy(batch, prev):
        steps.append([(r.num_computed_tokens, n, r.num_prompt_tokens)
                      for r, n in zip(batch.reqs, batch.num_new)])  # fmt: skip
        return launch(batch, prev)

    engine.executor.launch = spy
    return steps


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models["llama"], dtype="float32", max_num_batched_tokens=BUDGET,
               num_kv_blocks=256, max_model_len=256, kernel_warmup=False)  # fmt: skip


def test_warmup_runs_the_step_shapes_a_server_meets(llm):
    engine = llm.engine
    steps = launched_steps(engine)
    try:
        assert warm_up(engine) > 0
    finally:
        del engine.executor.launch
    rows = [row for step in steps for row in step]
    # a prompt longer than one chunk: a full chunk, then a chunk over cached context
    assert any(sum(n for _, n, _ in step) == BUDGET for step in steps)
    assert any(done > 0 and n > 1 and done < prompt for done, n, prompt in rows)
    assert any(n == 1 and done == 0 for done, n, _ in rows)  # a one-token prompt
    decode = lambda row: row[1] == 1 and row[0] >= row[2]  # noqa: E731
    assert any(any(map(decode, s)) and any(not decode(r) for r in s) for s in steps)  # mixed
    assert max(sum(map(decode, s)) for s in steps) >= 8  # a decode batch of several
    longest = [max(n for _, n, _ in s) for s in steps if not all(map(decode, s))]
    for lo, hi in ((2, 4), (5, 8), (16, BUDGET)):  # each tile size of the prefill kernel
        assert any(lo <= m <= hi for m in longest), (lo, hi, longest)


def test_warmup_leaves_the_engine_as_new(llm, tiny_models):
    engine = llm.engine
    warm_up(engine)
    assert not engine.requests and not engine.has_unfinished()
    engine.kv.check_invariants()
    assert engine.kv.num_free_blocks == engine.num_blocks
    assert not engine.kv.cached  # nothing of the warm-up is a prefix hit for a client
    m = engine.metrics()
    for key in ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions",
                "prompt_tokens", "prompt_tokens_computed", "generation_tokens"):  # fmt: skip
        assert m[key] == 0, key
    fresh = LLM(tiny_models["llama"], dtype="float32", max_num_batched_tokens=BUDGET,
                num_kv_blocks=256, max_model_len=256, kernel_warmup=False)  # fmt: skip
    want = [o.outputs[0].token_ids for o in fresh.generate(PROMPTS, GREEDY, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert got == want


def test_warmup_resets_speculation_counters(tiny_models):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    llm = LLM(tiny_models["llama"], dtype="float32", max_num_batched_tokens=BUDGET,
              num_kv_blocks=256, max_model_len=256, speculative_config=spec,
              kernel_warmup=True)  # fmt: skip
    spec_dec = llm.engine.spec
    assert spec_dec.num_drafts == spec_dec.num_draft_tokens == spec_dec.num_accepted_tokens == 0


def test_warmup_follows_the_flag_then_the_platform(tiny_models, monkeypatch):
    ran = []
    monkeypatch.setattr(core_mod, "warm_up", lambda engine: ran.append(engine))
    path = tiny_models["llama"]
    LLM(path, dtype="float32", num_kv_blocks=64)  # the CPU platform: no warm-up
    assert not ran
    llm = LLM(path, dtype="float32", num_kv_blocks=64, kernel_warmup=True)
    assert ran == [llm.engine]
    assert llm.engine.config.max_num_batched_tokens == 2048  # the CPU platform's default


def test_warmup_with_overlapped_steps(tiny_models):
    """As on GPUs: steps overlap; a failed warm-up request would raise."""
    llm = LLM(tiny_models["llama"], dtype="float32", max_num_batched_tokens=BUDGET,
              num_kv_blocks=256, max_model_len=256, async_scheduling=True,
              kernel_warmup=True)  # fmt: skip
    assert llm.engine.runner.overlap and not llm.engine.requests
    assert llm.engine.kv.num_free_blocks == llm.engine.num_blocks
