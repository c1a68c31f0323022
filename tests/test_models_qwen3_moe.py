"""Qwen3 (q/k norms), Qwen3-MoE and Mixtral (top-k routed experts): greedy output of tiny random
models token-identical to HF transformers in float32, with prefix caching and chunked prefill;
one MoE model with its experts split over two tensor-parallel ranks."""

from __future__ import annotations

import pytest
import torch
from test_hf_parity import hf_greedy

from paged import LLM, SamplingParams

BASE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=320,
    max_position_embeddings=512,
    eos_token_id=1,
    bos_token_id=0,
)


def make_model(kind: str, path: str, seed: int = 0) -> str:
    """A tiny random HF model of `kind` saved to `path` (weights scaled up, as in conftest, so
    greedy decoding is far from ties)."""
    import transformers as tf

    if kind == "qwen3":
        cfg = tf.Qwen3Config(**BASE, intermediate_size=128, head_dim=32)
    elif kind == "qwen3_moe":  # experts in layer 1 only; layer 0 dense (mlp_only_layers)
        cfg = tf.Qwen3MoeConfig(**BASE, intermediate_size=96, moe_intermediate_size=48,
                                num_experts=6, num_experts_per_tok=2, norm_topk_prob=True,
                                mlp_only_layers=[0], head_dim=16)  # fmt: skip
    elif kind == "qwen3_moe_unnorm":  # every layer sparse, top-3 weights not renormalised
        cfg = tf.Qwen3MoeConfig(**BASE, moe_intermediate_size=32, num_experts=5,
                                num_experts_per_tok=3, norm_topk_prob=False)  # fmt: skip
    elif kind == "mixtral":
        cfg = tf.MixtralConfig(**BASE, intermediate_size=48, num_local_experts=4,
                               num_experts_per_tok=2, sliding_window=None)  # fmt: skip
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
            elif "norm" in name:  # q/k norms not all ones: their weights matter
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return path


KINDS = ["qwen3", "qwen3_moe", "qwen3_moe_unnorm", "mixtral"]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("qwen3_moe")
    return {k: make_model(k, str(root / k)) for k in KINDS}


PREFIX = list(range(5, 45))
PROMPTS = [PREFIX + [50, 51], PREFIX + [60], [7, 8, 9], list(range(100, 170))]


@pytest.mark.parametrize("kind", KINDS)
def test_matches_hf(models, kind):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(models[kind], dtype=torch.float32).eval()
    # 16-token steps chunk the prompts; the shared prefix hits the prefix cache.
    llm = LLM(models[kind], dtype="float32", kv_cache_memory="8MiB", max_num_batched_tokens=16,
              max_model_len=256)  # fmt: skip
    try:
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        for p, o in zip(PROMPTS, outs, strict=True):
            assert o.outputs[0].token_ids == hf_greedy(hf, p, 16), (kind, len(p))
        assert llm.engine.kv.hits > 0
    finally:
        llm.engine.shutdown()


def test_moe_tensor_parallel_matches_one_rank(models):
    """Qwen3-MoE over two ranks (gloo): each holds half of every expert's columns and half
    of the dense layer's; greedy output equals one rank's."""
    kw = dict(dtype="float32", kv_cache_memory="8MiB", max_num_batched_tokens=16, max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    outs = {}
    for tp in (1, 2):
        llm = LLM(models["qwen3_moe"], tensor_parallel_size=tp, **kw)
        try:
            outs[tp] = [
                o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)
            ]
        finally:
            llm.engine.shutdown()
    assert outs[2] == outs[1]
