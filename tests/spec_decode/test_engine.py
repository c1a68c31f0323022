"""Speculative decoding end to end on tiny random models: greedy output token-identical to
plain decoding (n-gram proposals, the model drafting for itself, a different draft with the
same vocabulary), batched prompts of different lengths with chunked prefill, stops and
max_tokens inside an accepted run, logprobs, seeded sampling, preemption; no block leaks."""

from __future__ import annotations

import pytest
import torch

from paged import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    rnd = [torch.randint(2, 320, (n,), generator=g).tolist() for n in (3, 9, 70)]
    base = torch.randint(2, 320, (8,), generator=g).tolist()
    return [*rnd, base * 5, base[:3] * 9 + [5]]  # 70 tokens: three chunks of 32


def check_pool(llm: LLM) -> None:
    llm.engine.kv.check_invariants(list(llm.engine.requests.values()))
    assert llm.engine.kv.num_free_blocks == llm.engine.num_blocks, "blocks leaked"


def generate(llm: LLM, ps, params=GREEDY) -> list[list[int]]:
    out = [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]
    check_pool(llm)
    return out


def spec_stats(llm: LLM) -> dict[str, float]:
    return {k: v for k, v in llm.engine.metrics().items() if k.startswith("spec_decode")}


@pytest.fixture(scope="module")
def tiny(tiny_models) -> str:
    return tiny_models["llama"]


@pytest.fixture(scope="module")
def other_draft(tiny, tmp_path_factory) -> str:
    """A different model with the same vocabulary: the tiny model's weights, perturbed."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    path = str(tmp_path_factory.mktemp("draft") / "llama")
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def plain(tiny) -> LLM:
    return LLM(tiny, dtype="float32", num_kv_blocks=96, max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def reference(plain) -> list[list[int]]:
    return generate(plain, prompts())


def spec_llm(path: str, spec: dict, **kw) -> LLM:
    kw = {"num_kv_blocks": 96, "max_num_batched_tokens": 32, **kw}
    return LLM(path, dtype="float32", speculative_config=spec, **kw)


@pytest.mark.parametrize("method", ["ngram", "self", "other"])
def test_greedy_identical(tiny, other_draft, reference, method):
    spec = {
        "ngram": NGRAM,
        "self": {"model": tiny, "num_speculative_tokens": 3},
        "other": {"model": other_draft, "num_speculative_tokens": 3},
    }[method]
    llm = spec_llm(tiny, spec)
    assert generate(llm, prompts()) == reference
    s = spec_stats(llm)
    assert s["spec_decode_num_drafts"] > 0
    assert s["spec_decode_num_draft_tokens"] >= s["spec_decode_num_drafts"]
    per_pos = [s[f"spec_decode_num_accepted_tokens_per_pos_{i}"] for i in range(3)]
    assert sum(per_pos) == s["spec_decode_num_accepted_tokens"]
    assert per_pos == sorted(per_pos, reverse=True)  # accepted at i needs all before it
    if method == "self":  # the target drafting for itself: every proposal accepted
        assert s["spec_decode_num_accepted_tokens"] == s["spec_decode_num_draft_tokens"]
    if method == "other":
        assert s["spec_decode_num_accepted_tokens"] > 0
    before = s["spec_decode_num_accepted_tokens"]
    assert generate(llm, prompts()[:1]) == reference[:1]  # prefix-cache hit, counters grow
    assert spec_stats(llm)["spec_decode_num_drafts"] > s["spec_decode_num_drafts"]
    assert spec_stats(llm)["spec_decode_num_accepted_tokens"] >= before


@pytest.fixture(scope="module")
def self_draft(tiny) -> LLM:
    """Every proposal accepted: runs of 1 + K tokens per step, where stops must cut."""
    return spec_llm(tiny, {"model": tiny, "num_speculative_tokens": 4})


def test_stops_and_max_tokens_inside_a_run(self_draft, plain, reference):
    ps = prompts()
    ref = reference[2]
    j = next(i for i in range(5, len(ref)) if ref[i] not in ref[:i])
    stop = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[ref[j]])
    out = self_draft.generate([ps[2]], stop, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref[: j + 1] and out.finish_reason == "stop"
    for m in (1, 2, 7):
        short = SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
        out = self_draft.generate([ps[2]], short, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == ref[:m] and out.finish_reason == "length"
    check_pool(self_draft)


def test_requests_that_cannot_speculate_decode_plainly(self_draft, plain):
    """Penalties and min_tokens need the host to see each token: those requests decode one
    token a step, alongside others that speculate, with plain decoding's output."""
    ps = prompts()[:3]
    params = [
        SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=16, min_tokens=10, stop_token_ids=[7]),
        GREEDY,
    ]
    want = [o.outputs[0].token_ids for o in plain.generate(ps, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in self_draft.generate(ps, params, use_tqdm=False)]
    assert got == want
    check_pool(self_draft)


def test_logprobs_match_plain_decoding(self_draft, plain):
    ps = prompts()[3:]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True)
    want = plain.generate(ps, params, use_tqdm=False)
    got = self_draft.generate(ps, params, use_tqdm=False)
    for a, b in zip(want, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys()
            for t in la:
                assert la[t].rank == lb[t].rank
                assert abs(la[t].logprob - lb[t].logprob) < 1e-4


SEEDED = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=3, max_tokens=12,
                        ignore_eos=True, n=2)  # fmt: skip


def sampled(llm: LLM) -> list[list[list[int]]]:
    outs = llm.generate(prompts()[1:3], SEEDED, use_tqdm=False)
    check_pool(llm)
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.mark.parametrize("method", ["ngram", "self"])
def test_seeded_sampling_equals_plain_seeded_sampling(tiny, self_draft, plain, method):
    """A seeded request draws each position's noise from (seed, position): its proposals and
    their verification draw what plain decoding draws, so the tokens are plain decoding's,
    whatever the proposals and the batch (cold and warm prefix cache alike)."""
    llm = self_draft if method == "self" else spec_llm(tiny, NGRAM)
    want = sampled(plain)
    assert all(len(t) == 12 and all(0 <= x < 320 for x in t) for seqs in want for t in seqs)
    assert sampled(llm) == want
    assert sampled(llm) == want
    s = spec_stats(llm)
    assert s["spec_decode_num_draft_tokens"] > 0
    if method == "self":  # the draft draws with the target's noise from the same distribution
        assert s["spec_decode_num_accepted_tokens"] == s["spec_decode_num_draft_tokens"]


def test_preemption(tiny, reference):
    llm = spec_llm(tiny, NGRAM, num_kv_blocks=9, max_model_len=100)
    assert generate(llm, prompts()) == reference
    assert llm.engine.scheduler.num_preemptions > 0


def test_sampled_proposals_keep_the_drafts_distribution(self_draft):
    """A sampling request draws its proposals from the draft's own distribution (its
    temperature, top-k), kept as q: with the target drafting for itself p == q, so
    min(1, p / q) accepts (nearly) every proposal; with point masses it would accept ~p(x)."""
    before = spec_stats(self_draft)
    params = SamplingParams(temperature=0.9, top_k=40, seed=1, max_tokens=16, ignore_eos=True)
    generate(self_draft, prompts()[:2], params)
    s = spec_stats(self_draft)
    proposed = s["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
    accepted = s["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    assert proposed > 0 and accepted >= 0.95 * proposed


def test_small_token_budget_keeps_every_decode(tiny):
    """Lookahead slots never take the budget of the decodes after them: with 8 tokens a step
    and four decoding requests, every running request is in every step."""
    llm = spec_llm(tiny, {"model": tiny, "num_speculative_tokens": 4}, max_num_batched_tokens=8)
    eng, sched = llm.engine, llm.engine.scheduler
    for i, p in enumerate(prompts()[:2] + prompts()[3:]):
        eng.add_request(str(i), p, GREEDY)
    while any(r.num_output_tokens == 0 for r in eng.requests.values()):
        eng.step()  # the prompts, in chunks of 8
    seen, orig = [], sched.schedule

    def schedule():
        running = len(sched.running)
        batch = orig()
        seen.append((running, len(batch.reqs), sum(batch.lookahead.values())))
        return batch

    sched.schedule = schedule
    while eng.has_unfinished():
        eng.step()
    assert seen and all(running == n for running, n, _ in seen)
    assert any(k > 0 for *_, k in seen)  # and some steps still speculate
    check_pool(llm)


def test_context_length_inside_a_run(tiny):
    """Proposals never run past max_model_len: generation up to the context ends as plain."""
    ps = [p[:n] for p, n in zip(prompts()[2:], (40, 50, 37))]
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    plain = LLM(tiny, dtype="float32", num_kv_blocks=32, max_model_len=60)
    llm = spec_llm(tiny, {"model": tiny, "num_speculative_tokens": 4}, num_kv_blocks=32,
                   max_model_len=60)  # fmt: skip
    want = [(o.outputs[0].token_ids, o.outputs[0].finish_reason)
            for o in plain.generate(ps, params, use_tqdm=False)]  # fmt: skip
    got = [(o.outputs[0].token_ids, o.outputs[0].finish_reason)
           for o in llm.generate(ps, params, use_tqdm=False)]  # fmt: skip
    assert got == want and [len(t) for t, _ in got] == [60 - len(p) for p in ps]
    assert spec_stats(llm)["spec_decode_num_accepted_tokens"] > 0
    check_pool(llm)


def test_overlapped_steps(tiny, plain):
    """--async-scheduling with speculation: steps where a request may speculate resolve the
    step in flight first; the others overlap (here a request under min_tokens, which decodes
    plainly, alone at the end); outputs as plain decoding's."""
    ps = prompts()
    long = SamplingParams(temperature=0, max_tokens=40, min_tokens=40)
    params = [GREEDY, GREEDY, long, GREEDY, GREEDY]
    want = [o.outputs[0].token_ids for o in plain.generate(ps, params, use_tqdm=False)]
    for spec in (NGRAM, {"model": tiny, "num_speculative_tokens": 3}):
        llm = spec_llm(tiny, spec, async_scheduling=True)
        eng, overlapped = llm.engine, []
        can = eng._can_overlap
        eng._can_overlap = lambda can=can, seen=overlapped: seen.append(can()) or seen[-1]
        got = [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]
        assert got == want
        assert True in overlapped and False in overlapped
        assert spec_stats(llm)["spec_decode_num_drafts"] > 0
        check_pool(llm)
