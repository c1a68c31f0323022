"""The same greedy outputs whatever the batching: prefix caching, preemption, chunking."""

from __future__ import annotations

import pytest
import torch

from paged import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(2, 320, (37,), generator=g).tolist()
    out = [shared + torch.randint(2, 320, (n,), generator=g).tolist() for n in (1, 5, 20, 33)]
    out += [torch.randint(2, 320, (n,), generator=g).tolist() for n in (2, 16, 17, 64)]
    return out + [shared + [5, 6, 7]] * 2  # exact duplicates share every full block


def run(path: str, ps, **kw) -> tuple[list[list[int]], LLM]:
    llm = LLM(path, dtype="float32", **kw)
    outs = llm.generate(ps, GREEDY, use_tqdm=False)
    llm.engine.kv.check_invariants(list(llm.engine.requests.values()))
    assert llm.engine.kv.num_free_blocks == llm.engine.num_blocks, "pool not full again"
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.fixture(scope="module")
def reference(tiny_models):
    """One request at a time, no prefix caching, big pool."""
    path = tiny_models["llama"]
    llm = LLM(path, dtype="float32", enable_prefix_caching=False, num_kv_blocks=256)
    ref = []
    for p in prompts():
        ref.append(llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids)
        assert llm.engine.kv.num_free_blocks == 256
    return ref


def test_batched_with_prefix_cache(tiny_models, reference):
    got, _ = run(tiny_models["llama"], prompts(), num_kv_blocks=256)
    assert got == reference


def test_prefix_cache_hits_reported(tiny_models, reference):
    llm = LLM(tiny_models["llama"], dtype="float32", num_kv_blocks=256)
    p = prompts()[3]
    first = llm.generate([p], GREEDY, use_tqdm=False)[0]
    second = llm.generate([p], GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == (len(p) - 1) // 16 * 16 > 0
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_batched_without_prefix_cache(tiny_models, reference):
    got, _ = run(tiny_models["llama"], prompts(), num_kv_blocks=256, enable_prefix_caching=False)
    assert got == reference


def test_chunked_prefill_of_7_tokens(tiny_models, reference):
    got, llm = run(tiny_models["llama"], prompts(), num_kv_blocks=256, max_num_batched_tokens=7)
    assert got == reference
    # Requests admitted after the shared prefix was computed found it in the cache.
    assert llm.engine.kv.hits > 0


@pytest.mark.parametrize("prefix", [True, False])
def test_forced_preemption(tiny_models, reference, prefix):
    # 12 blocks of 16 tokens cannot hold ten requests of up to 104 tokens at once.
    got, llm = run(
        tiny_models["llama"],
        prompts(),
        num_kv_blocks=12,
        max_model_len=160,
        enable_prefix_caching=prefix,
    )
    assert got == reference
    assert llm.engine.scheduler.num_preemptions > 0


def test_small_blocks_and_few_seqs(tiny_models, reference):
    got, _ = run(
        tiny_models["llama"],
        prompts(),
        num_kv_blocks=400,
        block_size=4,
        max_num_seqs=3,
        max_num_batched_tokens=13,
    )
    assert got == reference


# ---- overlapped steps (async scheduling): the same tokens, the pool full again ------------
@pytest.mark.parametrize(
    "kw",
    [
        {"num_kv_blocks": 256},
        {"num_kv_blocks": 256, "max_num_batched_tokens": 7},
        {"num_kv_blocks": 12, "max_model_len": 160},
        {"num_kv_blocks": 12, "max_model_len": 160, "enable_prefix_caching": False},
        {"num_kv_blocks": 400, "block_size": 4, "max_num_seqs": 3, "max_num_batched_tokens": 13},
    ],
    ids=["prefix-cache", "chunks-of-7", "preemption", "preemption-no-cache", "small-blocks"],
)
def test_overlapped_steps_match(tiny_models, reference, kw):
    got, llm = run(tiny_models["llama"], prompts(), async_scheduling=True, **kw)
    assert llm.engine.runner.overlap
    assert got == reference


def test_overlapped_stops_and_penalties(tiny_models):
    """Stops land one step late under overlap (the extra token is dropped); penalty requests
    make the engine wait for each step: every output matches the plain engine's."""
    ps = prompts()
    ref = LLM(tiny_models["llama"], dtype="float32", num_kv_blocks=256)
    toks = ref.generate(ps[:3], GREEDY, use_tqdm=False)
    params = [
        SamplingParams(temperature=0, max_tokens=1),
        SamplingParams(
            temperature=0, max_tokens=9, stop_token_ids=[toks[0].outputs[0].token_ids[4]]
        ),
        SamplingParams(temperature=0, max_tokens=12, min_tokens=3),
        SamplingParams(temperature=0, max_tokens=15, repetition_penalty=1.3),
        SamplingParams(temperature=0.8, max_tokens=10, seed=3, logprobs=2),
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
    ]
    ps = ps[: len(params)]
    want = ref.generate(ps, params, use_tqdm=False)
    llm = LLM(tiny_models["llama"], dtype="float32", num_kv_blocks=256, async_scheduling=True)
    got = llm.generate(ps, params, use_tqdm=False)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].finish_reason == w.outputs[0].finish_reason
    lp_w, lp_g = want[4].outputs[0].logprobs, got[4].outputs[0].logprobs
    assert lp_w is not None and len(lp_g) == len(lp_w)
    for a, b in zip(lp_w, lp_g):
        assert a.keys() == b.keys()
    assert not llm.engine.has_unfinished()
    llm.engine.kv.check_invariants([])
    assert llm.engine.kv.num_free_blocks == llm.engine.num_blocks
