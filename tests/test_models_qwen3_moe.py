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


# --- GGUF: the same tiny models written as llama.cpp lays them out ------------------------

_GGUF = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_EXPERT_PARTS = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up",
                 "down_proj": "down", "w2": "down"}  # fmt: skip


def write_gguf(path: str, out: str, arch: str, stacked_experts: bool) -> str:
    """The HF model at `path` as a llama.cpp GGUF of `arch` (llama: q/k rows permuted as
    convert_hf_to_gguf does); experts stacked into ffn_*_exps [E, ...] or, as older Mixtral
    files have them, one ffn_gate.E tensor each."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(path)
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w = gguf.GGUFWriter(out, arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    experts = getattr(c, "num_experts", None) or getattr(c, "num_local_experts", None)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(c.num_experts_per_tok)
    if arch == "qwen3moe":
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        w.add_expert_weights_norm(c.norm_topk_prob)
    else:
        w.add_feed_forward_length(c.intermediate_size)
    stacks: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for name, t in load_file(f"{path}/model.safetensors").items():
        a = t.numpy()
        parts = name.split(".")
        if parts[1] != "layers":
            w.add_tensor(f"{_GGUF['.'.join(parts[:-1])]}.{parts[-1]}", a)
            continue
        block, rest = parts[2], ".".join(parts[3:-1])
        if ".experts." in name:  # ...experts.E.gate_proj.weight
            e, part = int(parts[-3]), _EXPERT_PARTS[parts[-2]]
            if stacked_experts:
                stacks.setdefault((block, part), {})[e] = a
            else:
                w.add_tensor(f"blk.{block}.ffn_{part}.{e}.weight", a)
            continue
        if arch == "llama" and rest in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = c.num_attention_heads if "q_proj" in rest else c.num_key_value_heads
            a = a.reshape(heads, 2, a.shape[0] // heads // 2, *a.shape[1:]).swapaxes(1, 2)
            a = a.reshape(t.shape)
        w.add_tensor(f"blk.{block}.{_GGUF[rest]}.{parts[-1]}", np.ascontiguousarray(a))
    for (block, part), by_expert in stacks.items():
        w.add_tensor(f"blk.{block}.ffn_{part}_exps.weight",
                     np.stack([by_expert[e] for e in range(len(by_expert))]))  # fmt: skip
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.mark.parametrize(
    "kind, arch, stacked",
    [("qwen3", "qwen3", True), ("qwen3_moe_unnorm", "qwen3moe", True), ("mixtral", "llama", False)],
)
def test_gguf_matches_hf(models, tmp_path, monkeypatch, kind, arch, stacked):
    from transformers import AutoModelForCausalLM

    from paged.model.loader import load_config, resolve_model

    monkeypatch.setenv("PAGED_CACHE_DIR", str(tmp_path / "cache"))
    gguf_path = write_gguf(models[kind], str(tmp_path / f"{kind}.gguf"), arch, stacked)
    cfg = load_config(resolve_model(gguf_path))
    hf = AutoModelForCausalLM.from_pretrained(models[kind], dtype=torch.float32).eval()
    assert cfg.architectures == hf.config.architectures
    llm = LLM(gguf_path, dtype="float32", kv_cache_memory="8MiB", max_model_len=256)
    try:
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[2:]], params, use_tqdm=False)
        for p, o in zip(PROMPTS[2:], outs, strict=True):
            assert o.outputs[0].token_ids == hf_greedy(hf, p, 12), (kind, len(p))
    finally:
        llm.engine.shutdown()


def test_platform_without_dynamic_shapes_refuses_moe_at_start_up(models, monkeypatch):
    from paged_cpu.platform import CpuPlatform

    class StaticShapes(CpuPlatform):  # as paged-tpu declares itself
        name = "static-shapes"
        unsupported_features = frozenset({"dynamic_shapes"})

    monkeypatch.setattr("paged.engine.core.select_platform", lambda name=None: StaticShapes())
    for kind, arch in (("mixtral", "MixtralForCausalLM"), ("qwen3_moe", "Qwen3MoeForCausalLM")):
        with pytest.raises(ValueError, match=f"{arch} cannot run on platform static-shapes"):
            LLM(models[kind], dtype="float32")
    llm = LLM(models["qwen3"], dtype="float32", kv_cache_memory="8MiB")  # dense: runs
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    assert len(llm.generate([{"prompt_token_ids": [3, 4]}], params)[0].outputs[0].token_ids) == 2
    llm.engine.shutdown()


@pytest.mark.parametrize(
    "shape, billions",
    [("qwen3-8b", 8.19), ("qwen3-30b-a3b", 30.53), ("gemma-3-12b", 11.77), ("phi-4-mini", 3.84)],
)
def test_named_shapes_build_with_the_published_parameter_counts(shape, billions):
    """The --load-format dummy shapes for benchmarks (built on the meta device: no memory)."""
    from unittest.mock import MagicMock

    from paged.model.registry import model_class
    from paged.model.shapes import shape_config

    cfg = shape_config(shape)
    with torch.device("meta"):
        model = model_class(cfg)(cfg, MagicMock(), 4096)
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == billions


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_hf_baseline_of_the_benchmarks_shares_the_experts(models, kind):
    """`paged bench --baseline hf` builds HF's model on paged's weights: the stacked experts
    map onto transformers' in-memory layout, so both compute the same logits."""
    from transformers import AutoModelForCausalLM

    from paged.cli.bench_hf import hf_from_paged

    llm = LLM(models[kind], dtype="float32", kv_cache_memory="8MiB", max_model_len=256)
    try:
        ours = hf_from_paged(llm.engine.runner.model, llm.engine.hf_config, torch.float32, "cpu")
        ref = AutoModelForCausalLM.from_pretrained(models[kind], dtype=torch.float32).eval()
        ids = torch.tensor([PROMPTS[3]])
        with torch.no_grad():
            torch.testing.assert_close(ours(ids).logits, ref(ids).logits, rtol=1e-4, atol=1e-4)
    finally:
        llm.engine.shutdown()
