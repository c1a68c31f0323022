"""bench/synthetic_gguf.py: random GGUF blocks in a named shape that paged reads as the shape
(config, weight statistics, a tokenizer that round-trips text), and Llama 3's rope scaling
baked as transformers computes it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _module():
    spec = importlib.util.spec_from_file_location("synthetic_gguf", BENCH / "synthetic_gguf.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["synthetic_gguf"] = mod
    spec.loader.exec_module(mod)
    return mod


syn = _module()


def test_rope_factors_are_transformers_llama3_scaling():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from paged.model.shapes import SHAPES, shape_config

    cfg = shape_config("llama-3.1-8b")
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    d = cfg.head_dim
    base = 1.0 / (cfg.rope_parameters["rope_theta"] ** (torch.arange(0, d, 2).double() / d))
    got = syn.rope_factors(SHAPES["llama-3.1-8b"])
    np.testing.assert_allclose(got, (base / scaled.double()).numpy(), rtol=1e-5)
    assert got.min() == 1.0 and got.max() == 8.0  # high frequencies kept, low ones / factor


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K", "Q4_K_M"])
def test_blocks_read_back_as_the_shape(tmp_path, kind):
    from paged.model.gguf_loader import gguf_config, iter_gguf
    from paged.model.shapes import SHAPES

    path = syn.write("smollm2-135m", kind, str(tmp_path / "m.gguf"), layers=2)
    cfg = gguf_config(str(path))
    want = SHAPES["smollm2-135m"]
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "vocab_size", "tie_word_embeddings")  # fmt: skip
    for key in keys:
        assert getattr(cfg, key) == want[key], key
    assert cfg.num_hidden_layers == 2
    weights = dict(iter_gguf(str(path), cfg, False))
    assert len(weights) == 2 * 9 + 2  # 9 a layer, the embedding (tied head) and the final norm
    w = weights["model.layers.1.mlp.down_proj.weight"].float()
    assert w.shape == (576, 1536)
    assert 0.018 < float(w.std()) < 0.022 and abs(float(w.mean())) < 0.004
    assert torch.equal(weights["model.norm.weight"], torch.ones(576))


def test_a_k_mix_types_its_tensors_as_llama_cpp_does(tmp_path):
    import gguf

    path = syn.write("smollm2-135m", "Q4_K_M", str(tmp_path / "m.gguf"), layers=9)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    # 9 layers: more bits in layer 0 and 7-8 (the first and last eighth), 3 and 6 (every third)
    assert [types[f"blk.{i}.ffn_down.weight"] for i in range(9)] == [
        "Q6_K", "Q4_K", "Q4_K", "Q6_K", "Q4_K", "Q4_K", "Q6_K", "Q6_K", "Q6_K"]  # fmt: skip
    assert types["blk.1.attn_q.weight"] == "Q8_0"  # 576 columns: no whole super-block of 256
    assert types["token_embd.weight"] == "Q8_0" and "output.weight" not in types  # tied


def test_engine_runs_the_file_and_its_tokenizer_round_trips(tmp_path, monkeypatch):
    from paged import LLM, SamplingParams

    monkeypatch.setenv("PAGED_CACHE_DIR", str(tmp_path / "cache"))  # not the user's cache
    path = syn.write("smollm2-135m", "Q4_0", str(tmp_path / "m.gguf"), layers=2)
    llm = LLM(str(path), max_model_len=128)
    text = "Hello there, é!"
    out = llm.generate([text], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)[0]  # fmt: skip
    assert out.prompt_token_ids == list(text.encode())  # every byte its own token
    assert llm.get_tokenizer().decode(out.prompt_token_ids) == text
    assert len(out.outputs[0].token_ids) == 4
