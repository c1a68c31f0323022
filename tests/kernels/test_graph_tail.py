"""The decode step's tail (LM head and greedy argmax) inside its graph, end to end on CPU: the
engine on the Triton backend (interpreted) with test_spec_graphs' replaying graph runner.
Greedy decodes take their tokens from the graph's argmax (the sampler does not run) and equal
HF's; sampled, penalised and logprob requests in the same batch sample from the graph's
logits and equal an eager engine's outputs."""

from __future__ import annotations

import torch
from test_hf_parity import hf_greedy
from test_spec_graphs import ReplayRunner, TritonGraphsOnCpu

from paged import LLM, SamplingParams
from paged.worker import model_runner


def test_decode_tail_in_graph(tiny_models, monkeypatch, interpreter_only):
    from transformers import AutoModelForCausalLM

    for where in ("paged.engine.core", "paged.worker.worker"):
        monkeypatch.setattr(f"{where}.select_platform", lambda name=None: TritonGraphsOnCpu())
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
