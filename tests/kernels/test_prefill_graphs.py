"""Steps with prompt chunks replayed from graphs, end to end on CPU: the engine on the Triton
backend (interpreted) with test_spec_graphs' replaying graph runner. Prompts of several
chunks, short prompts and decodes share steps (padded to a captured token count, the batch
padded with empty sequences); the tokens equal those of the same engine running such steps
eagerly, and HF's for greedy requests, with no blocks leaked."""

from __future__ import annotations

import pytest
import torch
from test_hf_parity import hf_greedy
from test_spec_graphs import ReplayRunner, TritonGraphsOnCpu

from paged import LLM, SamplingParams


@pytest.mark.slow  # 25 s: interpreted Triton through the engine, with the long checks
def test_prefill_graphs_equal_eager_steps(tiny_models, engines_on, interpreter_only):
    from transformers import AutoModelForCausalLM

    engines_on(TritonGraphsOnCpu())
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(2, 320, (n,), generator=g).tolist() for n in (70, 5, 23, 11)]
    params = [
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0.9, top_k=20, seed=3, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0, logprobs=1, max_tokens=6, ignore_eos=True),
    ]
    kw = dict(dtype="float32", max_model_len=128, max_num_batched_tokens=32, num_kv_blocks=64,
              max_num_seqs=4, enforce_eager=False)  # fmt: skip
    path = tiny_models["llama"]
    ReplayRunner.made.clear()
    llm = LLM(path, **kw)
    runner = ReplayRunner.made[-1]
    assert runner.prefill_sizes == [16, 32] and runner.prefill_reqs == 4
    got = llm.generate(prompts, params, use_tqdm=False)
    replays = {t: graph.replays for t, (graph, _, _) in runner.prefill_graphs.items()}
    assert replays[32] >= 3 and sum(replays.values()) >= 4  # the 70-token prompt's chunks too
    llm.engine.kv.check_invariants()
    assert llm.engine.kv.num_free_blocks == llm.engine.num_blocks

    eager = LLM(path, prefill_graphs=False, **kw)
    assert ReplayRunner.made[-1].prefill_graphs == {}
    want = eager.generate(prompts, params, use_tqdm=False)
    for o, w in zip(got, want):
        assert o.outputs[0].token_ids == w.outputs[0].token_ids
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert got[0].outputs[0].token_ids == hf_greedy(hf, prompts[0], 6)
    assert got[2].outputs[0].token_ids == hf_greedy(hf, prompts[2], 6)
