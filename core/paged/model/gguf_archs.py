"""llama.cpp's GGUF layout per architecture: tensor names as HF parameter names, and the
transformers config fields that an architecture's metadata gives or llama.cpp hard-codes (as
convert_hf_to_gguf.py writes the files and llama-model.cpp reads them)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from paged.model.loader import ModelLoadError

# general.architecture -> (transformers config class, architectures entry)
ARCHS: dict[str, tuple[str, str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
}
# general.architecture -> the same for files with {arch}.expert_count > 0
MOE_ARCHS = {"llama": ("MixtralConfig", "MixtralForCausalLM")}

TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",  # qwen3, gemma3
    "attn_k_norm": "self_attn.k_norm",
    # Mixture of experts: the router and the experts stacked [E, ...], yielded one expert
    # at a time ("*" is the expert index)
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.*.gate_proj",
    "ffn_up_exps": "mlp.experts.*.up_proj",
    "ffn_down_exps": "mlp.experts.*.down_proj",
}
# Gemma's four norms per layer: ffn_norm is the one before the MLP, not after attention
_GEMMA = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Phi-3 keeps the checkpoint's fused tensors (phi3.py splits them at load): q, k, v rows in
# attn_qkv (files with attn_q / attn_k / attn_v load too), gate then up rows in ffn_up
_PHI3 = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
BLOCKS: dict[str, dict[str, str]] = {
    arch: {**_BLOCK, **{"gemma2": _GEMMA, "gemma3": _GEMMA, "phi3": _PHI3}.get(arch, {})}
    for arch in ARCHS
}
# derived buffers, not parameters (their values are read into the config)
IGNORED = ("rope_freqs", "attn_rot_embd", "rope_factors_long", "rope_factors_short")
# Ollama's Gemma 3 files hold the vision tower (v.*) and projector (mm.*) too: paged runs
# the text model (llama.cpp keeps them in a separate mmproj file)
SKIPPED_PREFIXES = {"gemma3": ("v.", "mm.")}
PERMUTED_QK = frozenset({"llama"})  # convert_hf_to_gguf interleaves q/k rotary halves
NORM_SHIFT = {"gemma2": 1.0, "gemma3": 1.0}  # stored as 1 + w: Gemma's norms scale by (1 + w)

# get(key, default=None, array=False): the file's `{arch}.{key}` metadata value (a list for
# an array, where `array` allows one)
Get = Callable[..., Any]


def _gemma(arch: str, get: Get, kw: dict[str, Any], tensors: Mapping[str, Any]) -> None:
    """What the file does not store, as llama.cpp sets it: query_pre_attn_scalar = head_dim,
    hidden / heads on the 27B models (llama.cpp knows them by their layer count); every 2nd
    (Gemma 2) or 6th (Gemma 3) layer global, the others sliding (or Ollama's per-layer
    sliding_window_pattern); Gemma 2's window 4096 where unset."""
    layers, hidden, heads = kw["num_hidden_layers"], kw["hidden_size"], kw["num_attention_heads"]
    is_27b = layers == {"gemma2": 46, "gemma3": 62}[arch]
    kw["query_pre_attn_scalar"] = hidden // heads if is_27b else kw["head_dim"]
    window = get("attention.sliding_window", 4096 if arch == "gemma2" else None)
    pattern = 2 if arch == "gemma2" else get("attention.sliding_window_pattern", 6, array=True)
    if not isinstance(pattern, list):  # llama.cpp's set_swa_pattern: each group's last global
        pattern = [pattern == 0 or (i + 1) % pattern != 0 for i in range(layers)]
    if len(pattern) != layers:
        raise ModelLoadError(f"GGUF {arch}: sliding_window_pattern lists {len(pattern)} layers "
                             f"of {layers}")  # fmt: skip
    kw["sliding_window"] = window or None
    kw["layer_types"] = ["sliding_attention" if window and s else "full_attention" for s in pattern]
    kw["final_logit_softcapping"] = get("final_logit_softcapping")  # None: the HF default
    if arch == "gemma2":
        kw["attn_logit_softcapping"] = get("attn_logit_softcapping")
    else:
        _gemma3_rope(get, kw)


def _gemma3_rope(get: Get, kw: dict[str, Any]) -> None:
    """Sliding layers: theta freq_base_swa (10000 where older files have none), unscaled;
    global ones: freq_base with the file's scaling. Ollama's own files name them
    rope.local / rope.global.freq_base and leave out what Ollama's runtime corrects by layer
    count (as it does): 1B's final softcap (30, HF none), the linear factor 8 of 4B-27B."""
    ollama = get("rope.local.freq_base") is not None or get("rope.global.freq_base") is not None
    theta = get("rope.freq_base") or get("rope.global.freq_base") or 1000000.0
    full = {"rope_type": "default", "rope_theta": theta, **(kw.pop("rope_scaling", None) or {})}
    local = get("rope.freq_base_swa") or get("rope.local.freq_base") or 10000.0
    kw.pop("rope_theta")
    if ollama and (kw["sliding_window"] or 0) < (kw["max_position_embeddings"] or 0):
        layers = kw["num_hidden_layers"]
        if layers == 26:
            kw["final_logit_softcapping"] = None
        elif layers in (34, 48, 62) and full["rope_type"] == "default":
            full.update(rope_type="linear", factor=8.0)
    kw["rope_parameters"] = {
        "full_attention": full,
        "sliding_attention": {"rope_type": "default", "rope_theta": local},
    }


def _phi3(arch: str, get: Get, kw: dict[str, Any], tensors: Mapping[str, Any]) -> None:
    """Partial rotary from rope.dimension_count; sliding_window 0 (Phi-4) is none (llama.cpp
    ignores Phi's window, HF applies it: paged follows HF); LongRoPE from the
    rope_factors_long / _short tensors and rope.scaling.original_context_length."""
    kw.pop("head_dim")  # Phi3Config has none: hidden / heads (rope.dimension_count is less)
    if scaling := kw.pop("rope_scaling", None):  # convert_hf_to_gguf writes none for phi3
        raise ModelLoadError(f"GGUF phi3: rope scaling {scaling['rope_type']} is not supported")
    head_dim = kw["hidden_size"] // kw["num_attention_heads"]
    rot = get("rope.dimension_count", head_dim)
    kw["partial_rotary_factor"] = rot / head_dim
    kw["sliding_window"] = get("attention.sliding_window") or None
    rope = {"rope_type": "default", "rope_theta": kw.pop("rope_theta"),
            "partial_rotary_factor": rot / head_dim}  # fmt: skip
    kw["rope_parameters"] = rope
    orig = get("rope.scaling.original_context_length")
    if orig:
        kw["original_max_position_embeddings"] = orig
    found = {k: tensors.get(f"rope_factors_{k}.weight") for k in ("long", "short")}
    if all(t is None for t in found.values()):
        return
    missing = [f"rope_factors_{k}" for k, t in found.items() if t is None]
    if missing or not orig:
        what = missing[0] if missing else "phi3.rope.scaling.original_context_length"
        raise ModelLoadError(f"GGUF phi3: LongRoPE rope factors without {what}; paged cannot "
                             "apply LongRoPE to this file")  # fmt: skip
    factors = {k: [float(x) for x in np.asarray(t.data).ravel()] for k, t in found.items()}
    if any(len(f) != rot // 2 for f in factors.values()):
        sizes = ", ".join(f"{k} {len(f)}" for k, f in factors.items())
        raise ModelLoadError(
            f"GGUF phi3: LongRoPE factors ({sizes}) do not match {rot // 2} rotary frequencies"
        )
    rope.update(rope_type="longrope", long_factor=factors["long"],
                short_factor=factors["short"], original_max_position_embeddings=orig)  # fmt: skip
    # HF derives the attention factor from the context lengths as convert_hf_to_gguf did:
    # stated only where the file's differs (HF's own value otherwise, bit for bit)
    scale = kw["max_position_embeddings"] / orig
    derived = math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0
    attn = get("rope.scaling.attn_factor")
    if attn is not None and not math.isclose(attn, derived, rel_tol=1e-6):
        rope["attention_factor"] = attn


# general.architecture -> what fills in its config kwargs after the common fields
CONFIGS: dict[str, Callable[[str, Get, dict[str, Any], Mapping[str, Any]], None]] = {
    "gemma2": _gemma,
    "gemma3": _gemma,
    "phi3": _phi3,
}
