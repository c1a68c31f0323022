"""Gemma 2, Gemma 3 (text) and Phi-3 / Phi-3.5 / Phi-4-mini GGUF files, written as llama.cpp's
convert_hf_to_gguf.py writes them (gguf-py's own tensor-name table, Gemma's norms stored as
1 + w, Phi-3's fused q/k/v and gate/up rows, the metadata keys llama.cpp reads, a
SentencePiece vocabulary): paged's greedy output is token-identical to HF transformers on the
safetensors they came from (windowed models over prompts longer than the window, LongRoPE
generating across original_max_position_embeddings). Q8_0 linears computed from the file's
blocks match the dense load; a LongRoPE file paged cannot apply is refused."""

from __future__ import annotations

import math

import pytest
import torch
from test_hf_parity import hf_greedy

from paged import LLM, SamplingParams
from paged.model.loader import ModelLoadError, load_config, resolve_model
from paged.quantization import QuantLinear
from paged_cpu.linear import gguf_blocks_available

# The C++ kernels load once a process, from $PAGED_CACHE_DIR as it is before the tests move it
needs_vnni = pytest.mark.skipif(
    not gguf_blocks_available(), reason="no C++ kernels or no AVX-512 VNNI/BF16 here"
)

BASE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=320,
    max_position_embeddings=512,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
)
WINDOW = 8
ORIG = 32  # LongRoPE's original_max_position_embeddings
KINDS = ["gemma2", "gemma3", "phi3", "phi35"]
PREFIX = list(range(5, 45))
PROMPTS = [PREFIX + [50, 51], PREFIX + [60], [7, 8, 9], list(range(100, 170))]
# LongRoPE: prompts within ORIG (HF's one-shot prefill of a longer one rotates every position
# with the long factors), generation running past it
LONGROPE_PROMPTS = [list(range(5, 30)), list(range(5, 27)), [7, 8, 9], list(range(100, 131))]
MAX_TOKENS = 12
KW = dict(dtype="float32", kv_cache_memory="8MiB", max_num_batched_tokens=16, max_model_len=128)


def make_model(kind: str, path: str, seed: int = 0) -> str:
    """A tiny random HF model saved to `path`, shaped as the GGUF can state it: Gemma's
    query_pre_attn_scalar = head_dim and llama.cpp's layer patterns (Gemma 2 every 2nd layer
    global, Gemma 3 every 6th)."""
    import transformers as tf

    gemma = dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW)
    if kind == "gemma2":  # softcaps small, so that they matter
        cfg = tf.Gemma2Config(**BASE, **gemma, num_hidden_layers=2, attn_logit_softcapping=4.0,
                              final_logit_softcapping=6.0)  # fmt: skip
    elif kind == "gemma3":  # 5 sliding layers, 1 global with theta 1e6 linearly scaled; tied
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0,
                                   "rope_theta": 1000000.0}}  # fmt: skip
        cfg = tf.Gemma3TextConfig(**BASE, **gemma, num_hidden_layers=6, rope_parameters=rope)
        cfg.architectures = ["Gemma3ForCausalLM"]
    elif kind == "phi3":  # Phi-3-mini-4k: a window on every layer, no rope scaling
        cfg = tf.Phi3Config(**BASE, num_hidden_layers=2, sliding_window=WINDOW)
    elif kind == "phi35":  # Phi-3.5 / Phi-4-mini: LongRoPE, half of each head rotates, tied
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                "original_max_position_embeddings": ORIG,
                "short_factor": [1.0 + i / 4 for i in range(4)],
                "long_factor": [3.0 + i for i in range(4)]}  # fmt: skip
        cfg = tf.Phi3Config(**{**BASE, "max_position_embeddings": 128}, num_hidden_layers=2,
                            original_max_position_embeddings=ORIG, partial_rotary_factor=0.5,
                            rope_parameters=rope, tie_word_embeddings=True)  # fmt: skip
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embed_tokens" in name:  # Gemma scales it by sqrt(hidden)
                p.normal_(0, 0.03 if kind.startswith("gemma") else 0.5)
            elif p.dim() > 1:  # larger for Phi, or greedy settles on one repeated token
                p.normal_(0, 0.2 if kind.startswith("gemma") else 0.5)
            elif "norm" in name:  # Gemma's (1 + w) and Phi's w both away from 1
                p.uniform_(-0.5, 0.5) if kind.startswith("gemma") else p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return path


def vocab() -> tuple[list[str], list[float], list[int]]:
    """320 SentencePiece-style tokens (pad, eos, bos, unk, 256 bytes, pieces), their scores
    and llama.cpp token types, as convert_hf_to_gguf's _set_vocab_sentencepiece lists them."""
    import gguf

    letters = "abcdefghijklmnopqrstuvwxyz"
    pieces = [*letters, *(f"\u2581{c}" for c in letters), "\u2581", "\u2581the", "th", "he",
              "an", "in", "er", "on"]  # fmt: skip
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", *(f"<0x{i:02X}>" for i in range(256)), *pieces]
    t = gguf.TokenType
    types = [t.CONTROL, t.CONTROL, t.CONTROL, t.UNKNOWN, *[t.BYTE] * 256, *[t.NORMAL] * 60]
    scores = [0.0] * 260 + [-float(i) for i in range(60)]
    return tokens, scores, [int(x) for x in types]


def write_gguf(hf_dir: str, out: str, q8: bool = False, drop: str = "") -> str:
    """The HF model at `hf_dir` as convert_hf_to_gguf writes it (float32, or with every matrix
    Q8_0 as llama-quantize leaves a Q8_0 file: 1-D tensors stay float32), without the tensor
    `drop`."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(hf_dir)
    arch = {"gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3"}[c.model_type]
    w = gguf.GGUFWriter(out, arch)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    rope = c.rope_parameters
    if arch.startswith("gemma"):  # Gemma 2 writes no freq_base (llama.cpp's 10000 applies)
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
        w.add_sliding_window(c.sliding_window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    elif arch == "gemma3":
        full = rope["full_attention"]
        w.add_rope_freq_base(full["rope_theta"])
        w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        if full["rope_type"] == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])
    else:  # Phi3MiniModel.set_gguf_parameters / generate_extra_tensors
        heads, orig = c.num_attention_heads, c.original_max_position_embeddings
        w.add_rope_scaling_orig_ctx_len(orig)
        w.add_rope_dimension_count(int(rope["partial_rotary_factor"] * c.hidden_size) // heads)
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_sliding_window(c.sliding_window or 0)
        if rope["rope_type"] == "longrope":
            scale = c.max_position_embeddings / orig
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)))
            for k in ("long", "short"):
                if f"rope_factors_{k}" != drop:
                    w.add_tensor(f"rope_factors_{k}.weight", np.array(rope[f"{k}_factor"], "f4"))
    tokens, scores, types = vocab()
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    for key, value in (("pad", 0), ("eos", 1), ("bos", 2), ("unk", 3)):
        getattr(w, f"add_{key}_token_id")(value)
    if arch.startswith("gemma"):
        w.add_add_space_prefix(False)
    model_arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(model_arch, c.num_hidden_layers)
    for name, t in load_file(f"{hf_dir}/model.safetensors").items():
        base, suffix = name.rsplit(".", 1)
        a = t.float().numpy()
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            a = a + 1  # Gemma's norms scale by (1 + w): the file holds 1 + w
        gname = f"{names.get_name(base)}.{suffix}"
        if q8 and a.ndim == 2:
            q = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(gname, gguf.quants.quantize(a, q), raw_dtype=q)
        else:
            w.add_tensor(gname, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGED_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """kind -> (HF directory, its float32 GGUF)."""
    root = tmp_path_factory.mktemp("gguf_archs")
    out = {}
    for kind in KINDS:
        hf = make_model(kind, str(root / kind))
        out[kind] = hf, write_gguf(hf, str(root / f"{kind}.gguf"))
    return out


def close(a, b) -> bool:
    """Equal, floats to float32 precision (the file's metadata), through dicts and lists."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(map(close, a, b))
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-6)
    return a == b


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("kind", KINDS)
def test_gguf_matches_hf(models, kind):
    from transformers import AutoModelForCausalLM

    hf_dir, path = models[kind]
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    cfg = load_config(resolve_model(path))
    assert cfg.architectures == hf.config.architectures
    for field in ("query_pre_attn_scalar", "sliding_window", "layer_types", "head_dim",
                  "attn_logit_softcapping", "final_logit_softcapping", "tie_word_embeddings",
                  "original_max_position_embeddings"):  # fmt: skip
        assert getattr(cfg, field, None) == getattr(hf.config, field, None), field
    assert close(cfg.rope_parameters, hf.config.rope_parameters), cfg.rope_parameters
    prompts = LONGROPE_PROMPTS if kind == "phi35" else PROMPTS
    expect = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    if hf.config.sliding_window:  # the window matters: without it HF itself answers otherwise
        wide = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                                    sliding_window=4096).eval()  # fmt: skip
        assert [hf_greedy(wide, p, MAX_TOKENS) for p in prompts] != expect
    llm = LLM(path, **KW)
    try:
        assert greedy(llm, prompts) == expect
        tok = llm.get_tokenizer()  # transformers' GGUF vocabulary of the architecture
        ids = tok.encode("the ant", add_special_tokens=False)
        assert ids and max(ids) < 320 and tok.decode(ids) == "the ant"
        out = llm.generate("the ant", SamplingParams(max_tokens=3, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 3
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("arch, layers, scalar", [("gemma2", 2, 32), ("gemma2", 46, 16),
                                                  ("gemma3", 62, 16)])  # fmt: skip
def test_query_pre_attn_scalar_as_llama_cpp_sets_it(tmp_path, arch, layers, scalar):
    """Not in the file: head_dim (32 here), but hidden / heads (64 / 4) on the 27B models,
    which llama.cpp knows by their layer count."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), arch)
    w.add_block_count(layers)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_key_length(32)
    w.add_sliding_window(16)
    w.add_tensor("token_embd.weight", np.zeros((10, 64), "f4"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    from paged.model.gguf_loader import gguf_config

    cfg = gguf_config(str(tmp_path / "m.gguf"))
    assert (cfg.query_pre_attn_scalar, cfg.head_dim, cfg.vocab_size) == (scalar, 32, 10)
    every = 2 if arch == "gemma2" else 6
    assert cfg.layer_types[every - 2 : every] == ["sliding_attention", "full_attention"]


@pytest.mark.parametrize("layers", [26, 34])
def test_ollama_gemma3_layout(tmp_path, layers):
    """Ollama's own Gemma 3 files: rope.global / rope.local.freq_base, a per-layer
    sliding_window_pattern, no rms epsilon, the vision tower and projector in the same file
    (skipped), and what Ollama's runtime corrects by layer count: the 1B's final softcap
    (none in HF's config), the 4B-27B's linear rope factor 8 on the global layers."""
    import gguf
    import numpy as np

    from paged.model.gguf_loader import gguf_config, iter_gguf

    path = str(tmp_path / "ollama.gguf")
    w = gguf.GGUFWriter(path, "gemma3")
    w.add_block_count(layers)
    w.add_context_length(32768)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_key_length(16)
    w.add_sliding_window(512)
    w.add_float32("gemma3.rope.global.freq_base", 1000000.0)
    w.add_float32("gemma3.rope.local.freq_base", 10000.0)
    w.add_float32("gemma3.final_logit_softcapping", 30.0)
    w.add_sliding_window_pattern([(i + 1) % 6 != 0 for i in range(layers)])
    for name in ("token_embd.weight", "v.blk.0.attn_q.weight", "mm.mm_input_projection.weight"):
        w.add_tensor(name, np.zeros((10, 64), "f4"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    cfg = gguf_config(path)
    full = {"rope_type": "default", "rope_theta": 1000000.0}
    if layers == 34:
        full.update(rope_type="linear", factor=8.0)
    assert close(cfg.rope_parameters["full_attention"], full), cfg.rope_parameters
    assert cfg.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
    assert cfg.final_logit_softcapping == (None if layers == 26 else 30.0)
    assert cfg.layer_types[4:7] == ["sliding_attention", "full_attention", "sliding_attention"]
    assert cfg.rms_norm_eps == 1e-6 and cfg.query_pre_attn_scalar == 16
    assert [n for n, _ in iter_gguf(path, cfg, progress=False)] == ["model.embed_tokens.weight"]


def _reference_blocks_platform():
    """The CPU platform with the GGUF's block layers as paged.quantization.gguf keeps them
    (the cuda plugin's path, torch reference ops): exact in float32."""
    from gguf_blocks_platform import blocks_platform

    return blocks_platform()


@pytest.mark.parametrize("kind", ["gemma3", "phi35"])
def test_q8_0_blocks_match_the_dense_load(models, tmp_path, engines_on, kind):
    """Every linear Q8_0 (Phi-3's fused qkv and gate_up as single tensors, Gemma's float32
    norms beside them): the layers kept as the file's blocks, 4 a layer, greedy
    token-identical to the dense load of the same file."""
    hf_dir, _ = models[kind]
    path = write_gguf(hf_dir, str(tmp_path / f"{kind}-q8_0.gguf"), q8=True)
    prompts = LONGROPE_PROMPTS[:2] if kind == "phi35" else PROMPTS[:3:2] + PROMPTS[3:]
    dense = LLM(path, **KW)
    try:
        want = greedy(dense, prompts)
    finally:
        dense.engine.shutdown()
    platform = _reference_blocks_platform()
    engines_on(platform)
    llm = LLM(path, **KW)
    try:
        layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, QuantLinear)]
        assert platform.replaced == len(layers) == 4 * llm.engine.hf_config.num_hidden_layers
        assert {m.method.bits for m in layers} == {8}
        assert greedy(llm, prompts) == want
    finally:
        llm.engine.shutdown()


@needs_vnni
@pytest.mark.parametrize("kind", ["gemma3", "phi35"])
def test_cpu_gguf_blocks_in_bf16(models, tmp_path, kind):
    """The CPU plugin's own path (--cpu-gguf-blocks: bf16, 8-bit activations) on a Q8_0
    file: every linear layer and the tied head compute from the file's blocks, and the
    prompt's log-probabilities move from the float32 load's about as much as bf16's own
    (the dense bf16 load's) do."""
    from paged_cpu.linear import GgufBlockLinear

    hf_dir, _ = models[kind]
    path = write_gguf(hf_dir, str(tmp_path / f"{kind}-q8_0.gguf"), q8=True)
    prompt = LONGROPE_PROMPTS[0]
    params = SamplingParams(max_tokens=1, prompt_logprobs=1)
    runs = {"float32": {}, "bf16": {"dtype": "bfloat16", "cpu_gguf_blocks": False},
            "blocks": {"dtype": "bfloat16"}}  # fmt: skip
    logprobs = {}
    for run, kw in runs.items():
        llm = LLM(path, **{**KW, **kw})
        try:
            n = sum(isinstance(m, GgufBlockLinear) for m in llm.engine.runner.model.modules())
            layers = llm.engine.hf_config.num_hidden_layers
            assert n == (4 * layers + 1 if run == "blocks" else 0)  # + the tied head
            out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
            lps = out[0].prompt_logprobs[1:]
            logprobs[run] = [e[t].logprob for t, e in zip(prompt[1:], lps, strict=True)]
        finally:
            llm.engine.shutdown()

    def drift(run: str) -> float:
        pairs = zip(logprobs[run], logprobs["float32"], strict=True)
        return sum(abs(a - b) for a, b in pairs) / len(logprobs[run])

    assert drift("blocks") <= 3 * drift("bf16") + 0.02, (drift("blocks"), drift("bf16"))


def test_longrope_without_both_factors_is_refused(models, tmp_path):
    """Never loaded with a rope it cannot apply: the error names what is missing."""
    hf_dir, _ = models["phi35"]
    path = write_gguf(hf_dir, str(tmp_path / "broken.gguf"), drop="rope_factors_short")
    with pytest.raises(ModelLoadError, match="LongRoPE rope factors without rope_factors_short"):
        LLM(path, **KW)
