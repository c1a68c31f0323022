"""vLLM's sampling semantics offline: n samples forked from one prompt computation, best_of."""

from __future__ import annotations

import dataclasses

import pytest

from paged import LLM, SamplingParams

PROMPT = list(range(3, 21))  # 18 tokens: four full blocks of 4 and a partial one
SAMPLE = dict(temperature=1.0, max_tokens=8, ignore_eos=True)


def _llm(path: str, **kw) -> LLM:
    kw = {"num_kv_blocks": 128, "block_size": 4, "enable_prefix_caching": False} | kw
    return LLM(path, dtype="float32", **kw)


@pytest.fixture(scope="module")
def llm(tiny_models):
    return _llm(tiny_models["llama"])


def _computed(llm: LLM) -> int:
    return llm.engine.metrics()["prompt_tokens_computed"]


def _singles(llm: LLM, n: int, seed: int) -> list[list[int]]:
    params = [SamplingParams(**SAMPLE, seed=seed + i) for i in range(n)]
    return [o.outputs[0].token_ids for o in llm.generate([PROMPT] * n, params, use_tqdm=False)]


@pytest.mark.parametrize("overlap", [False, True])
def test_n_samples_compute_the_prompt_once_and_equal_seeded_singles(tiny_models, overlap):
    llm = _llm(tiny_models["llama"], async_scheduling=overlap)
    before = _computed(llm)
    out = llm.generate(PROMPT, SamplingParams(n=4, seed=7, **SAMPLE), use_tqdm=False)[0]
    assert _computed(llm) - before == len(PROMPT)  # not 4x: the samples share its blocks
    assert llm.engine.metrics()["prompt_tokens"] == len(PROMPT)
    samples = [o.token_ids for o in out.outputs]
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(s) for s in samples}) > 1
    before = _computed(llm)
    assert samples == _singles(llm, 4, 7)
    assert _computed(llm) - before == 4 * len(PROMPT)
    llm.engine.kv.check_invariants()
    assert llm.engine.kv.num_free_blocks == llm.engine.num_blocks


def test_forked_samples_survive_preemption_and_greedy_stays_greedy(tiny_models):
    ref = _llm(tiny_models["llama"])
    want = _singles(ref, 3, 11)
    greedy = ref.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    # 9 blocks: the prompt's 5 and the samples' growth do not fit, so some are preempted.
    small = _llm(tiny_models["llama"], num_kv_blocks=9, max_model_len=32)
    out = small.generate(PROMPT, SamplingParams(n=3, seed=11, **SAMPLE), use_tqdm=False)[0]
    assert [o.token_ids for o in out.outputs] == want
    assert small.engine.scheduler.num_preemptions > 0
    g = small.generate(PROMPT, SamplingParams(n=2, temperature=0, max_tokens=8), use_tqdm=False)
    assert [o.token_ids for o in g[0].outputs] == [greedy[0].outputs[0].token_ids] * 2
    small.engine.kv.check_invariants()
    assert small.engine.kv.num_free_blocks == small.engine.num_blocks


def test_aborted_leader_hands_the_prompt_to_the_next_sample(llm):
    eng = llm.engine
    eng.add_request("r", PROMPT, SamplingParams(n=3, seed=3, **SAMPLE))
    eng.abort(["r-0"])  # before its prompt ran: r-1 computes it, r-2 is forked from it
    got: dict[str, list[int]] = {"r-1": [], "r-2": []}
    while eng.has_unfinished():
        for eo in eng.step():
            got[eo.request_id] += eo.new_token_ids
    assert [got["r-1"], got["r-2"]] == _singles(llm, 3, 3)[1:]
    eng.kv.check_invariants()
    assert eng.kv.num_free_blocks == eng.num_blocks


def test_more_samples_than_seats_run_in_groups(tiny_models):
    llm = _llm(tiny_models["llama"], max_num_seqs=2)
    out = llm.generate(PROMPT, SamplingParams(n=5, seed=1, **SAMPLE), use_tqdm=False)[0]
    assert [o.token_ids for o in out.outputs] == _singles(llm, 5, 1)
    llm.engine.kv.check_invariants()


def test_best_of_keeps_the_n_most_likely(llm):
    p = SamplingParams(n=2, best_of=5, seed=4, **SAMPLE)
    out = llm.generate(PROMPT, p, use_tqdm=False)[0]
    every = llm.generate(PROMPT, SamplingParams(n=5, seed=4, logprobs=0, **SAMPLE), use_tqdm=False)[
        0
    ].outputs
    best = sorted(every, key=lambda o: -o.cumulative_logprob)[:2]
    assert [o.token_ids for o in out.outputs] == [o.token_ids for o in best]
    assert [o.index for o in out.outputs] == [0, 1]
    assert all(o.logprobs is None for o in out.outputs)  # not asked for
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(n=3, best_of=2)


def test_forked_blocks_are_copied_on_every_rank(tiny_models):
    llm = _llm(tiny_models["llama"], tensor_parallel_size=2)
    try:
        out = llm.generate(PROMPT, SamplingParams(n=3, seed=2, **SAMPLE), use_tqdm=False)[0]
        assert [o.token_ids for o in out.outputs] == _singles(llm, 3, 2)
    finally:
        llm.engine.shutdown()


def test_prompt_logprobs_match_hf_forward_across_chunks(tiny_models):
    import torch
    import transformers as tf

    hf = tf.AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32)
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT])).logits[0].log_softmax(-1)  # row j: token j + 1
    # 8-token steps: the 18-token prompt's rows come from three chunks; the prefix cache is on
    # but prompt_logprobs computes every row (a cached prefix has no logits).
    llm = _llm(tiny_models["llama"], max_num_batched_tokens=8, enable_prefix_caching=True)
    llm.generate(PROMPT, SamplingParams(max_tokens=2), use_tqdm=False)  # cache the prefix
    p = SamplingParams(n=2, temperature=0, max_tokens=3, prompt_logprobs=3, logprobs=2)
    out = llm.generate(PROMPT, p, use_tqdm=False)[0]
    lps = out.prompt_logprobs
    assert len(lps) == len(PROMPT) and lps[0] is None
    for j, (tok, entry) in enumerate(zip(PROMPT[1:], lps[1:])):
        row = want[j]
        assert abs(entry[tok].logprob - row[tok].item()) < 1e-4
        assert entry[tok].rank == int((row > row[tok]).sum()) + 1
        top = row.topk(3)
        for r, (v, t) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
            assert abs(entry[t].logprob - v) < 1e-4 and entry[t].rank == r
    first = out.outputs[0].logprobs[0]
    tok = out.outputs[0].token_ids[0]
    assert abs(first[tok].logprob - want[-1].max().item()) < 1e-4 and first[tok].rank == 1
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    llm.engine.kv.check_invariants()


def test_engine_seed_seeds_unseeded_sampling(tiny_models):
    p = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)

    def run(seed: int) -> list[list[int]]:
        llm = _llm(tiny_models["llama"], seed=seed)
        return [o.outputs[0].token_ids for o in llm.generate([PROMPT] * 3, p, use_tqdm=False)]

    first = run(7)
    assert run(7) == first
    assert run(8) != first


def test_chat_template_kwargs_and_continue_final_message(smollm):
    template = "{% for m in messages %}{{ m['content'] }}|{% endfor %}{{ greeting }}"
    conv = [{"role": "user", "content": "hi"}]
    out = smollm.chat(conv, SamplingParams(max_tokens=1), use_tqdm=False, chat_template=template,
                      chat_template_kwargs={"greeting": "ahoy"})[0]  # fmt: skip
    assert out.prompt.endswith("hi|ahoy")
    conv.append({"role": "assistant", "content": "Hello th"})
    out = smollm.chat(conv, SamplingParams(max_tokens=1), use_tqdm=False,
                      add_generation_prompt=False, continue_final_message=True)[0]  # fmt: skip
    assert out.prompt.endswith("Hello th")


def test_chat_tools_reach_the_template(smollm):
    """LLM.chat(tools=...) hands the definitions to the template, as vLLM's does."""
    template = "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{{ messages[0].content }}"
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    conv = [{"role": "user", "content": "hi"}]
    out = smollm.chat(conv, SamplingParams(max_tokens=1), use_tqdm=False, chat_template=template,
                      tools=tools)[0]  # fmt: skip
    assert out.prompt == "[get_weather]hi"


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory, tiny_models) -> str:
    """A tiny Llama with 12 tokens: every 3-token continuation can be enumerated."""
    import torch
    import transformers as tf

    path = str(tmp_path_factory.mktemp("vocab12") / "llama")
    cfg = tf.LlamaConfig.from_pretrained(tiny_models["llama"], vocab_size=12)
    torch.manual_seed(3)
    model = tf.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    model.save_pretrained(path)
    return path


def _reference_beams(path: str, prompt: list[int], width: int, steps: int, ignore_eos: bool):
    """Every continuation of `steps` tokens scored by HF (float32), then vLLM's beam rule:
    keep the `width` best live ones per step, set aside those that end with EOS (1) unless
    ignore_eos; rank by cumulative logprob / length (prompt included, a final EOS not)."""
    eos = None if ignore_eos else 1
    import itertools

    import torch
    import transformers as tf

    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    seqs = torch.tensor([prompt + list(c) for c in itertools.product(range(12), repeat=steps)])
    with torch.no_grad():
        lp = hf(seqs).logits.log_softmax(-1)
    p = len(prompt)
    tok_lp = lp[:, p - 1 : -1].gather(2, seqs[:, p:, None]).squeeze(2)  # [N, steps]
    cum = {tuple(s[p:].tolist()): tok_lp[i].cumsum(0).tolist() for i, s in enumerate(seqs)}
    live, done = [()], []
    for t in range(steps):
        cand = [b + (k,) for b in live for k in range(12)]
        score = {c: cum[c + (0,) * (steps - t - 1)][t] for c in cand}
        done += [(c, score[c]) for c in cand if c[-1] == eos]
        live = sorted((c for c in cand if c[-1] != eos), key=lambda c: -score[c])[:width]
    ranked = done + [(b, cum[b][-1]) for b in live]
    length = {c: p + len(c) - (c[-1] == 1) for c, _ in ranked}
    ranked.sort(key=lambda cs: -cs[1] / length[cs[0]])
    return ranked[:width]


@pytest.mark.parametrize("ignore_eos", [True, False])
def test_beam_search_matches_a_brute_force_reference(small_vocab, ignore_eos):
    from paged import BeamSearchParams

    prompt, width, steps = [0, 5, 7, 3, 9], 3, 3
    want = _reference_beams(small_vocab, prompt, width, steps, ignore_eos)
    llm = _llm(small_vocab, enable_prefix_caching=True)
    params = BeamSearchParams(beam_width=width, max_tokens=steps, ignore_eos=ignore_eos)
    got = llm.beam_search([prompt], params)[0].sequences
    assert [tuple(s.tokens[len(prompt) :]) for s in got] == [c for c, _ in want]
    for s, (_, cum) in zip(got, want):
        assert s.cum_logprob == pytest.approx(cum, abs=1e-4)
    llm.engine.kv.check_invariants()
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=11, max_tokens=2)


def test_stream_honours_output_kind(llm):
    from paged.sampling.params import RequestOutputKind as Kind

    p = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    want = llm.generate(PROMPT, p, use_tqdm=False)[0].outputs[0]
    got = {}
    for kind in Kind:
        outs = list(llm.stream([PROMPT], dataclasses.replace(p, output_kind=kind)))
        got[kind] = [o.outputs[0] for o in outs]
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert [len(o.token_ids) for o in got[Kind.CUMULATIVE]] == [1, 2, 3, 4, 5, 6]
    assert [t for o in got[Kind.DELTA] for t in o.token_ids] == want.token_ids
    assert all(len(o.token_ids) == 1 and len(o.logprobs) == 1 for o in got[Kind.DELTA])
    assert len(got[Kind.FINAL_ONLY]) == 1
    for final in (got[Kind.CUMULATIVE][-1], got[Kind.FINAL_ONLY][0]):
        assert final.token_ids == want.token_ids and final.logprobs == want.logprobs
    with pytest.raises(ValueError, match="best_of"):
        next(llm.stream([PROMPT], SamplingParams(n=1, best_of=2)))


def test_penalty_request_joins_overlapped_decodes(tiny_models):
    """A request with penalties scheduled beside decodes whose newest tokens are still in
    flight (overlapped steps: placeholders in their outputs) samples as without overlap."""
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    penal = SamplingParams(temperature=0, repetition_penalty=1.5, frequency_penalty=1.0,
                           presence_penalty=0.5, max_tokens=10, ignore_eos=True)  # fmt: skip
    got = {}
    for overlap in (False, True):
        engine = _llm(tiny_models["llama"], async_scheduling=overlap).engine
        assert engine.runner.overlap == overlap
        engine.add_request("a", PROMPT, greedy)
        outs = engine.step() + engine.step() + engine.step()  # "a" decodes
        engine.add_request("b", PROMPT[:7], penal)
        while engine.has_unfinished():
            outs += engine.step()
        assert not [o.error for o in outs if o.error]
        got[overlap] = {rid: [t for o in outs if o.request_id == rid for t in o.new_token_ids]
                        for rid in ("a", "b")}  # fmt: skip
        assert engine.kv.num_free_blocks == engine.num_blocks
    assert got[True] == got[False] and len(got[True]["b"]) == 10
