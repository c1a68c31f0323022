"""Sliding-window Mistral and Qwen2, Gemma 2 and Gemma 3 (text), Phi-3 and Phi-4-mini (fused
projections, LongRoPE, partial rotary): greedy output of tiny random models token-identical
to HF transformers in float32, with chunked prefill and prefix hits. Windowed models get
prompts longer than the window (HF's own output differs without it, so it is exercised);
LongRoPE models generate across original_max_position_embeddings (short factors below it,
long ones from there)."""

from __future__ import annotations

import pytest
import torch
from test_hf_parity import hf_greedy
from tiny_hf import spread_weights

from paged import LLM, SamplingParams

BASE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=320,
    max_position_embeddings=512,
    eos_token_id=1,
    bos_token_id=0,
    pad_token_id=0,
)
WINDOW = 8
ORIG = 32  # LongRoPE's original_max_position_embeddings


def make_model(kind: str, path: str, seed: int = 0) -> str:
    """A tiny random HF model of `kind` saved to `path` (weights scaled up, as in conftest,
    so greedy decoding is far from ties; norm weights random so (1 + w) matters)."""
    import transformers as tf

    if kind == "mistral":
        cfg = tf.MistralConfig(**BASE, sliding_window=WINDOW)
    elif kind == "qwen2_sliding":  # layer 0 global, layer 1 sliding (max_window_layers)
        cfg = tf.Qwen2Config(**BASE, use_sliding_window=True, sliding_window=WINDOW,
                             max_window_layers=1)  # fmt: skip
    elif kind == "gemma2":  # layer 0 sliding, layer 1 global; both softcaps small to matter
        cfg = tf.Gemma2Config(**BASE, head_dim=16, sliding_window=WINDOW,
                              query_pre_attn_scalar=24, attn_logit_softcapping=4.0,
                              final_logit_softcapping=6.0)  # fmt: skip
    elif kind == "gemma3":  # local/global thetas, the global one linearly scaled
        cfg = tf.Gemma3TextConfig(**BASE, head_dim=16, sliding_window=WINDOW,
                                  layer_types=["sliding_attention", "full_attention"],
                                  query_pre_attn_scalar=32,
                                  rope_parameters={
                                      "sliding_attention": {"rope_type": "default",
                                                            "rope_theta": 10000.0},
                                      "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                         "rope_theta": 1000000.0}})  # fmt: skip
        cfg.architectures = ["Gemma3ForCausalLM"]
    elif kind in ("phi3", "phi4mini"):  # Phi-4-mini: half the head rotates, tied embeddings
        partial = 0.5 if kind == "phi4mini" else 1.0
        half = int(16 * partial) // 2
        rope = {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": partial,
            "original_max_position_embeddings": ORIG,
            "short_factor": [1.0 + i / 4 for i in range(half)],
            "long_factor": [3.0 + i for i in range(half)],
        }
        kw = {**BASE, "max_position_embeddings": 256, "tie_word_embeddings": kind == "phi4mini"}
        cfg = tf.Phi3Config(**kw, original_max_position_embeddings=ORIG,
                            partial_rotary_factor=partial, rope_parameters=rope)  # fmt: skip
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embed_tokens" in name:  # Gemma scales it by sqrt(hidden): keep it from
                p.normal_(0, 0.03)  # drowning the layers (greedy would echo the input)
            elif p.dim() > 1:  # Phi: larger, or greedy settles on one repeated token
                p.normal_(0, 0.5 if kind.startswith("phi") else 0.2)
            elif "norm" in name:
                p.uniform_(-0.5, 0.5)
    model.save_pretrained(path)
    return path


KINDS = ["mistral", "qwen2_sliding", "gemma2", "gemma3"]
PREFIX = list(range(5, 45))
PROMPTS = [PREFIX + [50, 51], PREFIX + [60], [7, 8, 9], list(range(100, 170))]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("gemma_phi")
    return {k: make_model(k, str(root / k)) for k in KINDS}


@pytest.mark.parametrize("kind", KINDS)
def test_matches_hf(models, kind):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(models[kind], dtype=torch.float32).eval()
    expect = [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]
    # The window matters: without it HF itself answers otherwise.
    wide = AutoModelForCausalLM.from_pretrained(models[kind], dtype=torch.float32,
                                                sliding_window=4096).eval()  # fmt: skip
    assert [hf_greedy(wide, p, MAX_TOKENS) for p in PROMPTS] != expect
    # 16-token steps chunk the prompts (windows span chunks); the shared prefix hits.
    llm = LLM(models[kind], dtype="float32", kv_cache_memory="8MiB", max_num_batched_tokens=16,
              max_model_len=256)  # fmt: skip
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expect
        assert llm.engine.kv.hits > 0
    finally:
        llm.engine.shutdown()


PHI_KINDS = ["phi3", "phi4mini"]
# Prompts within ORIG (HF's one-shot prefill of a longer prompt rotates every position with
# the long factors), generation running past it.
PHI_PROMPTS = [list(range(5, 30)), list(range(5, 27)), [7, 8, 9], list(range(100, 131))]


@pytest.fixture(scope="module")
def phi_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("phi")
    return {k: make_model(k, str(root / k)) for k in PHI_KINDS}


@pytest.mark.parametrize("kind", PHI_KINDS)
def test_phi_matches_hf(phi_models, kind):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(phi_models[kind], dtype=torch.float32).eval()
    expect = [hf_greedy(hf, p, MAX_TOKENS) for p in PHI_PROMPTS]
    llm = LLM(phi_models[kind], dtype="float32", kv_cache_memory="8MiB", max_num_batched_tokens=16,
              max_model_len=128)  # fmt: skip
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PHI_PROMPTS], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expect
        assert llm.engine.kv.hits > 0
    finally:
        llm.engine.shutdown()


def test_longrope_table_switches_at_the_original_length(phi_models):
    """Rows below original_max_position_embeddings use the short factors, the rest the long
    ones, both scaled by HF's attention factor."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from paged.model.llama import rope_cache

    cfg = AutoConfig.from_pretrained(phi_models["phi3"])
    table = rope_cache(cfg, 64)
    short, scale = ROPE_INIT_FUNCTIONS["longrope"](cfg, "cpu")
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](cfg, "cpu", seq_len=ORIG + 1)
    assert scale > 1.0 and not torch.allclose(short, long)
    for pos, inv in ((ORIG - 1, short), (ORIG, long), (63, long)):
        assert torch.allclose(table[pos, : inv.numel()], (pos * inv).cos() * scale)


# --- Llama 3.x rope scaling from a GGUF's rope_freqs ---------------------------------------

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}  # fmt: skip


def llama3_rope_freqs(rope: dict, dim: int) -> list[float]:
    """The rope_freqs tensor as llama.cpp's convert_hf_to_gguf writes it for rope_type llama3."""
    import math

    base, factor = rope["rope_theta"], rope["factor"]
    low, high, orig = (rope[k] for k in ("low_freq_factor", "high_freq_factor",
                                         "original_max_position_embeddings"))  # fmt: skip
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * base ** (i / dim)
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def test_llama3_rope_scaling_from_gguf(tmp_path, monkeypatch):
    """A Llama with rope_type llama3 written as llama.cpp does (the scaling baked into a
    rope_freqs tensor, no metadata): paged's GGUF load matches HF's safetensors load; HF
    without the scaling answers otherwise, so the factors are applied."""
    import gguf
    import numpy as np
    import transformers as tf
    from test_models_qwen3_moe import write_gguf

    monkeypatch.setenv("PAGED_CACHE_DIR", str(tmp_path / "cache"))
    cfg = tf.LlamaConfig(**BASE, head_dim=16, rope_parameters=dict(LLAMA3_ROPE))
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg).eval()
    spread_weights(model)
    path = str(tmp_path / "llama3")
    model.save_pretrained(path)
    freqs = np.array(llama3_rope_freqs(LLAMA3_ROPE, 16), dtype=np.float32)

    class WithRopeFreqs(gguf.GGUFWriter):
        def write_header_to_file(self, *args, **kwargs):
            self.add_tensor("rope_freqs.weight", freqs)
            super().write_header_to_file(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFWriter", WithRopeFreqs)
    gguf_path = write_gguf(path, str(tmp_path / "llama3.gguf"), "llama", False)
    monkeypatch.undo()

    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expect = [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]
    plain = tf.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, rope_parameters={"rope_type": "default", "rope_theta": 1e4}
    ).eval()
    assert [hf_greedy(plain, p, MAX_TOKENS) for p in PROMPTS] != expect
    llm = LLM(gguf_path, dtype="float32", kv_cache_memory="8MiB", max_num_batched_tokens=16,
              max_model_len=256)  # fmt: skip
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expect
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("kind", ["gemma2", "gemma3", "phi4mini"])
def test_hf_baseline_of_the_benchmarks_on_our_weights(tmp_path, kind):
    """`paged bench --baseline hf` builds HF's model on paged's weights (fused QKV and
    gate-up split back, buffers HF computes at construction rebuilt): the same logits."""
    from transformers import AutoModelForCausalLM

    from paged.cli.bench_hf import hf_from_paged

    path = make_model(kind, str(tmp_path / kind))
    llm = LLM(path, dtype="float32", kv_cache_memory="8MiB", max_model_len=256)
    try:
        ours = hf_from_paged(llm.engine.runner.model, llm.engine.hf_config, torch.float32, "cpu")
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        ids = torch.tensor([PROMPTS[3]])
        with torch.no_grad():
            torch.testing.assert_close(ours(ids).logits, ref(ids).logits, rtol=1e-4, atol=1e-4)
    finally:
        llm.engine.shutdown()
