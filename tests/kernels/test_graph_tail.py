"""The decode step's tail (LM head and greedy argmax) inside its graph, end to end on CPU: the
engine on the Triton backend (interpreted) with test_spec_graphs' replaying graph runner.
Greedy decodes take their tokens from the graph's argmax (the sampler does not run) and equal
HF's; sampled, penalised and logprob requests in the same batch sample from the graph's
logits and equal an eager engine's outputs."""

from __future__ import annotations

import pytest
import torch
from test_hf_parity import hf_greedy
from test_spec_graphs import ReplayRunner, TritonGraphsOnCpu

from paged import LLM, SamplingParams
from paged.worker import model_runner


@pytest.mark.slow  # 25 s: interpreted Triton through the engine, with the long checks
def test_decode_tail_in_graph(tiny_models, monkeypatch, engines_on, interpreter_only):
    from transformers import AutoModelForCausalLM

    engines_on(TritonGraphsOnCpu())
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 320, (n,), generator=g).tolist() for n in (5, 11, 40)]
    kw = dict(dtype="float32", max_model_len=128, max_num_batched_tokens=32, num_kv_blocks=64,
              max_num_seqs=4)  # fmt: skip
    path = tiny_models["llama"]
    ReplayRunner.made.clear()
    llm = LLM(path, enforce_eager=False, **kw)
    runner = ReplayRunner.made[-1]
    assert runner.tail is not None and sorted(runner.tails) == [1, 2, 4]

    calls = []
    real_sample = model_runner.sample
    monkeypatch.setattr(model_runner, "sample", lambda *a: calls.append(1) or real_sample(*a))
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    got = llm.generate(prompts[:1], greedy, use_tqdm=False)[0].outputs[0].token_ids
    replays = sum(graph.replays for graph, _, _ in runner.graphs.values())
    assert replays == 5 and len(calls) == 1  # the prefill samples; five decodes in the graph
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert got == hf_greedy(hf, prompts[0], 6)

    mixed = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0, logprobs=2, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0, repetition_penalty=1.5, max_tokens=8, ignore_eos=True),
    ]
    outs = llm.generate(prompts, mixed, use_tqdm=False)
    llm.engine.kv.check_invariants()
    eager = LLM(path, enforce_eager=True, **kw)
    want = eager.generate(prompts, mixed, use_tqdm=False)
    for o, w in zip(outs, want):
        assert o.outputs[0].token_ids == w.outputs[0].token_ids
    lps, want_lps = outs[1].outputs[0].logprobs, want[1].outputs[0].logprobs
    assert [sorted(d) for d in lps] == [sorted(d) for d in want_lps]
    for d, w in zip(lps, want_lps):
        assert all(abs(d[t].logprob - w[t].logprob) < 1e-5 for t in d)


@pytest.mark.slow  # 27 s: interpreted Triton through the engine, with the long checks
def test_sampled_decodes_draw_in_sampler_graphs(
    tiny_models, monkeypatch, engines_on, interpreter_only
):
    """Requests that sample with temperature, top-k/top-p and min-p alone take their decode
    tokens from the sampler graphs (the eager sampler runs for prefills only) and, from the
    same --seed, equal an eager engine's tokens; a seeded request samples eagerly."""
    engines_on(TritonGraphsOnCpu())
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(2, 320, (n,), generator=g).tolist() for n in (7, 12, 3, 20)]
    kw = dict(dtype="float32", max_model_len=128, max_num_batched_tokens=64, num_kv_blocks=64,
              max_num_seqs=4, seed=11)  # fmt: skip
    path = tiny_models["llama"]
    ReplayRunner.made.clear()
    llm = LLM(path, enforce_eager=False, **kw)
    runner = ReplayRunner.made[-1]
    assert sorted(runner.sample_graphs) == [(n, s) for n in (1, 2, 4) for s in (False, True)]
    eager = LLM(path, enforce_eager=True, **kw)

    calls = []
    real_sample = model_runner.sample
    monkeypatch.setattr(model_runner, "sample", lambda *a: calls.append(1) or real_sample(*a))
    common = dict(max_tokens=6, ignore_eos=True)
    mixes = {
        "plain": [SamplingParams(temperature=0.9, **common)],
        "filters": [
            SamplingParams(temperature=1.0, top_p=0.9, **common),
            SamplingParams(temperature=0, logprobs=1, **common),
            SamplingParams(temperature=0.7, top_k=20, min_p=0.05, **common),
            SamplingParams(temperature=1.2, **common),
        ],
    }
    for name, params in mixes.items():
        calls.clear()
        before = {k: graph.replays for k, (graph, _) in runner.sample_graphs.items()}
        ps = prompts[: len(params)]
        torch.manual_seed(11)  # (both engines draw from torch's one default generator)
        got = llm.generate(ps, params, use_tqdm=False)
        replays = {k: graph.replays - before[k] for k, (graph, _) in runner.sample_graphs.items()}
        sort = name == "filters"
        assert replays[(len(ps), sort)] == 5 and sum(replays.values()) == 5, name
        assert len(calls) == 1, name  # the prefill step (every prompt in one step)
        torch.manual_seed(11)
        want = eager.generate(ps, params, use_tqdm=False)
        for o, w in zip(got, want):
            assert o.outputs[0].token_ids == w.outputs[0].token_ids, name
        if sort:  # the greedy row's logprobs, from the graph's logits
            lp, want_lp = got[1].outputs[0].logprobs, want[1].outputs[0].logprobs
            assert [sorted(d) for d in lp] == [sorted(d) for d in want_lp]
    calls.clear()
    seeded = SamplingParams(temperature=0.9, seed=5, **common)
    got = llm.generate(prompts[:1], seeded, use_tqdm=False)[0].outputs[0].token_ids
    assert len(calls) == 6  # its own generator: every step samples eagerly
    assert got == eager.generate(prompts[:1], seeded, use_tqdm=False)[0].outputs[0].token_ids
    llm.engine.kv.check_invariants()
