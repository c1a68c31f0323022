"""--runner / --pooler-config and the sentence-transformers files, without running a model."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from emb_helpers import save_sentence_transformers

from paged.config import EngineConfig
from paged.model.loader import ModelSource
from paged.model.pooling_config import resolve_pooler, resolve_runner, sentence_transformers_pooling


def hf(arch: str, tied: bool = False, **kw):
    return SimpleNamespace(architectures=[arch], tie_word_embeddings=tied, hidden_size=64, **kw)


def test_flags_checked():
    with pytest.raises(ValueError, match="runner must be one of auto, generate, pooling"):
        EngineConfig(runner="embed")
    with pytest.raises(ValueError, match="pooler_config.pooling_type: must be one of LAST"):
        EngineConfig(pooler_config='{"pooling_type": "MAX"}')
    with pytest.raises(ValueError, match="pooler_config: unsupported key"):
        EngineConfig(pooler_config={"pooling_type": "MEAN", "dimensions": 8})
    with pytest.raises(ValueError, match="pooler_config: not valid JSON"):
        EngineConfig(pooler_config="{")


@pytest.mark.parametrize(
    ("mode", "normalize"), [("lasttoken", True), ("mean_tokens", False), ("cls_token", True)]
)
def test_sentence_transformers_defaults_and_override(tmp_path, mode, normalize):
    save_sentence_transformers(str(tmp_path), mode, normalize)
    kind = {"lasttoken": "LAST", "mean_tokens": "MEAN", "cls_token": "CLS"}[mode]
    src = ModelSource(str(tmp_path), "hf", "m")
    cfg = hf("Qwen3ForCausalLM", tied=True)
    assert resolve_runner("auto", cfg, src) == "pooling"  # an embedding model, head or not
    assert resolve_runner("generate", cfg, src) == "generate"
    p = resolve_pooler(None, cfg, src)
    assert (p.pooling_type, p.normalize, p.is_matryoshka) == (kind, normalize, False)
    p = resolve_pooler('{"normalize": false}', hf("X", matryoshka_dimensions=[16, 32]), src)
    assert (p.pooling_type, p.normalize, p.matryoshka_dimensions) == (kind, False, (16, 32))


def test_unsupported_sentence_transformers_modules(tmp_path):
    save_sentence_transformers(str(tmp_path), "max_tokens", False)
    with pytest.raises(ValueError, match="got pooling_mode_max_tokens"):
        sentence_transformers_pooling(str(tmp_path))
    pool = tmp_path / "1_Pooling" / "config.json"
    config = json.loads(pool.read_text())
    config |= {"pooling_mode_max_tokens": False, "pooling_mode_lasttoken": True}
    pool.write_text(json.dumps(config | {"include_prompt": False}))
    with pytest.raises(ValueError, match="include_prompt false"):
        sentence_transformers_pooling(str(tmp_path))
    pool.write_text(json.dumps(config))
    modules = json.loads((tmp_path / "modules.json").read_text())
    modules.append({"idx": 2, "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match="module Dense"):
        sentence_transformers_pooling(str(tmp_path))


def test_runner_auto_without_head(tmp_path):
    """A bare decoder architecture, or an untied checkpoint with no lm_head tensor: pooling."""
    import torch
    from safetensors.torch import save_file

    save_file({"embed_tokens.weight": torch.zeros(4, 2)}, str(tmp_path / "model.safetensors"))
    src = ModelSource(str(tmp_path), "hf", "m")
    assert resolve_runner("auto", hf("Qwen3Model"), None) == "pooling"
    assert resolve_runner("auto", hf("LlamaForCausalLM"), src) == "pooling"
    assert resolve_runner("auto", hf("LlamaForCausalLM", tied=True), src) == "generate"
    save_file({"lm_head.weight": torch.zeros(4, 2)}, str(tmp_path / "model.safetensors"))
    assert resolve_runner("auto", hf("LlamaForCausalLM"), src) == "generate"
