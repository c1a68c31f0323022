"""--load-format: exactly auto | safetensors | gguf | dummy, each honoured or refused."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import pytest

from paged.config import EngineConfig
from paged.model.loader import ModelLoadError, resolve_model


def test_only_the_four_formats():
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    for fmt in ("auto", "safetensors", "gguf", "dummy"):
        assert (
            EngineConfig.from_cli_args(parser.parse_args(["--load-format", fmt])).load_format == fmt
        )
    with pytest.raises(SystemExit):  # argparse: invalid choice
        parser.parse_args(["--load-format", "pt"])
    with pytest.raises(ValueError, match="load_format"):
        EngineConfig(load_format="bitsandbytes")
    with pytest.raises(ModelLoadError, match="load_format"):
        resolve_model(None, load_format="npcache")


def test_each_format_takes_its_own_kind(tiny_models, default_model_path):
    hf = tiny_models["llama"]
    assert resolve_model(hf, "auto").kind == resolve_model(hf, "safetensors").kind == "hf"
    gguf = default_model_path
    assert resolve_model(gguf, "auto").kind == resolve_model(gguf, "gguf").kind == "gguf"
    with pytest.raises(ModelLoadError, match="load_format safetensors: .* is a GGUF file"):
        resolve_model(gguf, "safetensors")
    with pytest.raises(ModelLoadError, match="load_format gguf: .* is a safetensors directory"):
        resolve_model(hf, "gguf")
    with pytest.raises(ModelLoadError, match="load_format safetensors"):
        resolve_model(None, "safetensors")  # the default model is a GGUF


def test_dummy_needs_only_the_config(tiny_models, tmp_path):
    """A directory with config.json and no weights: dummy runs it, the others refuse."""
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(Path(tiny_models["llama"], "config.json"), bare)
    for fmt in ("auto", "safetensors"):
        with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
            resolve_model(str(bare), fmt)
    from paged import LLM, SamplingParams

    llm = LLM(str(bare), load_format="dummy", dtype="float32", max_model_len=64,
              kv_cache_memory="4MiB")  # fmt: skip
    out = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_engine_refuses_a_mismatch_before_loading(default_model_path):
    from paged import LLM

    with pytest.raises(ModelLoadError, match="is a GGUF file"):
        LLM(default_model_path, load_format="safetensors")


def test_paged_models_lists_builtins_and_plugins(capsys):
    """`paged models`: every registered architecture, its provider and load formats."""
    import json
    import types

    from paged.cli.main import main
    from paged.hookspecs import hookimpl
    from paged.model.llama import LlamaForCausalLM
    from paged.plugins import get_plugin_manager

    class AcmeForCausalLM(LlamaForCausalLM):
        pass

    plugin = types.SimpleNamespace(
        paged_models=hookimpl(lambda: {"AcmeForCausalLM": AcmeForCausalLM})
    )
    pm = get_plugin_manager()
    pm.register(plugin, name="acme-models")
    try:
        assert main(["models", "--json"]) == 0
        rows = {r["architecture"]: r for r in json.loads(capsys.readouterr().out)["models"]}
        assert main(["models"]) == 0
        table = capsys.readouterr().out
    finally:
        pm.unregister(plugin)
    assert rows["LlamaForCausalLM"]["load_formats"] == ["safetensors", "gguf", "dummy"]
    assert rows["LlamaForCausalLM"]["provider"] == "paged"
    assert rows["MistralForCausalLM"]["model_class"] == "paged.model.llama.LlamaForCausalLM"
    assert rows["AcmeForCausalLM"]["provider"] == "acme-models"
    assert rows["AcmeForCausalLM"]["load_formats"] == ["safetensors", "dummy"]
    assert "AcmeForCausalLM" in table and "Qwen2ForCausalLM" in table


def test_dummy_generates_without_a_head_tensor(tiny_models, tmp_path):
    """The benchmarks' shape directories: config.json (untied head) and an empty
    model.safetensors. With dummy weights the head is drawn too: the model generates (it is
    not taken for a headless embedding checkpoint)."""
    import json

    from safetensors.torch import save_file

    from paged import LLM, SamplingParams

    shape = tmp_path / "shape"
    shape.mkdir()
    cfg = json.loads(Path(tiny_models["llama"], "config.json").read_text())
    (shape / "config.json").write_text(json.dumps(cfg | {"tie_word_embeddings": False}))
    save_file({}, str(shape / "model.safetensors"))
    llm = LLM(str(shape), load_format="dummy", dtype="float32", max_model_len=64,
              kv_cache_memory="4MiB")  # fmt: skip
    out = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
