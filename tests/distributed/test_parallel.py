"""Tensor and pipeline parallelism on CPU: gloo, two worker processes on the two cores.

Greedy float32 output must equal one rank's, with the prefix cache, chunked prefill and
preemption in play; a divergence is only allowed at a near-tie of the top two logprobs (and
is reported). Models: tiny random Llama, Qwen2 (biases, tied embeddings), a Llama with one KV
head (fewer KV heads than ranks: replicated), and the default model (9 query heads over 3 KV
heads: split 3 + 6 between the ranks).
"""

from __future__ import annotations

import pytest
import torch
from dist_helpers import generate_then_kill
from tiny_hf import spread_weights

from paged import LLM, SamplingParams
from paged.executor import WorkerFailure

PREFIX = list(range(3, 40))
PROMPTS = [
    PREFIX + [41, 42],  # a shared prefix: prefix-cache hits
    PREFIX + [43],
    list(range(50, 120)),  # 70 tokens: several prefill chunks of 16
    [7, 8, 9],
    [11] * 30,
]
# 16-token steps chunk the prompts; 14 blocks of 16 tokens cannot hold all five sequences
# at once, so some are preempted and recomputed.
ENGINE = dict(dtype="float32", max_num_batched_tokens=16, num_kv_blocks=14, max_model_len=128)
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def mqa_model(tmp_path_factory) -> str:
    import transformers as tf

    path = str(tmp_path_factory.mktemp("mqa") / "llama-mqa")
    cfg = tf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1, vocab_size=320,
                         max_position_embeddings=512, eos_token_id=1)  # fmt: skip
    torch.manual_seed(1)
    model = tf.LlamaForCausalLM(cfg)
    spread_weights(model)
    model.save_pretrained(path)
    return path


def run(path: str | None, **kw) -> tuple[list, LLM]:
    llm = LLM(path, **kw)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        return [o.outputs[0] for o in outs], llm
    finally:
        llm.engine.shutdown()


def assert_same(got: list, ref: list) -> None:
    """Identical tokens, or a first divergence at a near-tie of ref's top two logprobs."""
    for g, r in zip(got, ref):
        if g.token_ids == r.token_ids:
            continue
        i = next(i for i, (a, b) in enumerate(zip(g.token_ids, r.token_ids)) if a != b)
        top = sorted((v.logprob for v in r.logprobs[i].values()), reverse=True)[:2]
        gap = top[0] - top[1]
        print(f"divergence at token {i}: top-2 logprob gap {gap:.2e}")
        assert gap < 1e-3, f"diverged at token {i} with a top-2 gap of {gap:.3f}"


@pytest.mark.parametrize(
    "model, tp, pp",
    [("llama", 2, 1), ("qwen2", 2, 1), ("mqa", 2, 1), ("llama", 1, 2), ("qwen2", 1, 2)],
)
def test_parallel_matches_one_rank(tiny_models, mqa_model, model, tp, pp):
    path = mqa_model if model == "mqa" else tiny_models[model]
    ref, one = run(path, **ENGINE)
    got, llm = run(path, **ENGINE, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    assert llm.engine.scheduler.num_preemptions > 0  # the workload preempts
    assert llm.engine.kv.hits > 0  # and hits the prefix cache
    assert_same(got, ref)


@pytest.mark.slow  # 19 s, two ranks of the default model (tiny models above): with the long checks
def test_default_model_tensor_parallel(default_model_path, smollm):
    kw = dict(dtype="float32", max_model_len=256, kv_cache_memory="32MiB")
    outs = smollm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    ref = [o.outputs[0] for o in outs]  # one rank: the session's float32 default model
    got, llm = run(default_model_path, **kw, tensor_parallel_size=2)
    heads = [a.self_attn.num_heads for a in llm.engine.runner.model.layers[:1]]
    assert heads == [3]  # the driver's share of 9 query heads (1 of 3 KV heads)
    assert_same(got, ref)


def test_dead_worker_fails_the_engine_in_bounded_time(tiny_models):
    llm = LLM(tiny_models["llama"], dtype="float32", num_kv_blocks=64, tensor_parallel_size=2)
    err, hung, seconds = generate_then_kill(llm, llm.engine.executor.procs[0].kill)
    assert not hung, "the engine hung after its worker died"
    assert isinstance(err, WorkerFailure | RuntimeError), err
    assert "worker" in str(err), err
    assert seconds < 30
    llm.engine.shutdown()
