"""GGUF files (llama.cpp): config from metadata; weights dequantized to float32 with HF names.
The per-architecture tables (names, norms, config fields) are in gguf_archs.py."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from paged.model.gguf_archs import (
    ARCHS,
    BLOCKS,
    CONFIGS,
    IGNORED,
    MOE_ARCHS,
    NORM_SHIFT,
    PERMUTED_QK,
    SKIPPED_PREFIXES,
    TOP,
)
from paged.model.loader import ModelLoadError, _show

__all__ = ["ARCHS", "MOE_ARCHS", "gguf_config", "hf_name", "iter_gguf", "iter_gguf_blocks"]
log = logging.getLogger(__name__)

_NAME = re.compile(r"(?:blk\.(\d+)\.)?(\w+)\.(weight|bias)")
_EXPERT = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight")  # older Mixtral files


def _reader(path: str) -> Any:
    from gguf import GGUFReader

    log.info("reading GGUF metadata of %s", path)
    try:
        return GGUFReader(path)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read GGUF file {_show(path)}: {e}") from e


def _meta(reader: Any, key: str, default: Any = None, array: bool = False) -> Any:
    """A scalar or string metadata value; an array as a list where `array` allows one (else
    refused: where paged reads one value, a per-layer list would be misread)."""
    from gguf import GGUFValueType

    field = reader.fields.get(key)
    if field is None or not field.data:
        return default
    kind = field.types[0]
    if kind == GGUFValueType.ARRAY:
        if array:
            return list(field.contents())
        raise ModelLoadError(f"GGUF metadata {key} is an array; paged expects one value")
    part = field.parts[field.data[0]]
    if kind == GGUFValueType.STRING:
        return bytes(part).decode("utf-8", errors="replace")
    return part[0].item()


def _architecture(reader: Any) -> str:
    arch = _meta(reader, "general.architecture")
    if arch not in ARCHS:
        raise ModelLoadError(
            f"unsupported GGUF architecture {_show(str(arch))}; paged reads: {', '.join(ARCHS)}"
        )
    return arch


def gguf_config(path: str) -> Any:
    """The transformers config (LlamaConfig, Gemma2Config, ...) a GGUF file's metadata describes."""
    import transformers

    reader = _reader(path)
    arch = _architecture(reader)

    def get(key: str, default: Any = None, array: bool = False) -> Any:
        return _meta(reader, f"{arch}.{key}", default, array)

    def tok(key: str) -> Any:
        return _meta(reader, f"tokenizer.ggml.{key}")

    hidden, heads = get("embedding_length"), get("attention.head_count")
    tensors = {t.name: t for t in reader.tensors}
    vocab = get("vocab_size")
    if "token_embd.weight" in tensors:  # the embedding's rows (Gemma 3 files drop unused ones)
        vocab = int(tensors["token_embd.weight"].shape[-1])
    elif vocab is None and "tokenizer.ggml.tokens" in reader.fields:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length"),
        num_hidden_layers=get("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=get("attention.head_count_kv", heads),
        head_dim=get("attention.key_length") or get("rope.dimension_count") or hidden // heads,
        max_position_embeddings=get("context_length"),
        rms_norm_eps=get("attention.layer_norm_rms_epsilon"),
        rope_theta=get("rope.freq_base", 10000.0),
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=tok("bos_token_id"),
        eos_token_id=tok("eos_token_id"),
        pad_token_id=tok("padding_token_id"),
        architectures=[ARCHS[arch][1]],
    )
    if arch in ("llama", "qwen3", "qwen3moe"):
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in tensors
    config_cls = ARCHS[arch][0]
    experts = get("expert_count")
    if experts:
        gating = get("expert_gating_func")
        if gating not in (None, 1):  # LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
            raise ModelLoadError(f"GGUF {arch}: expert gating function {gating} unsupported")
        kwargs["num_experts_per_tok"] = get("expert_used_count")
    if arch in MOE_ARCHS and experts:
        config_cls, kwargs["architectures"] = MOE_ARCHS[arch][0], [MOE_ARCHS[arch][1]]
        kwargs.update(num_local_experts=experts, sliding_window=None)
    elif arch == "qwen3moe":
        kwargs.update(
            num_experts=experts,
            moe_intermediate_size=get("expert_feed_forward_length"),
            norm_topk_prob=bool(get("expert_weights_norm", True)),  # llama.cpp renormalises
            decoder_sparse_step=1,  # every layer has experts in llama.cpp's qwen3moe
            mlp_only_layers=[],
        )
        kwargs["intermediate_size"] = kwargs["intermediate_size"] or kwargs["moe_intermediate_size"]
    scaling, factor = get("rope.scaling.type"), get("rope.scaling.factor")
    if scaling in ("linear", "yarn") and factor:
        kwargs["rope_scaling"] = {"rope_type": scaling, "factor": factor}
        if scaling == "yarn":
            orig = get("rope.scaling.original_context_length")
            kwargs["rope_scaling"]["original_max_position_embeddings"] = orig
    elif scaling not in (None, "none") and not (scaling == "longrope" and arch == "phi3"):
        log.warning("GGUF rope scaling %r is not applied", scaling)
    if "rope_freqs.weight" in tensors:  # Llama 3.x rope scaling, as convert_hf_to_gguf bakes it
        rope_freqs = np.asarray(tensors["rope_freqs.weight"].data).ravel()
        kwargs["rope_freq_factors"] = [float(x) for x in rope_freqs]
    if arch in CONFIGS:
        CONFIGS[arch](arch, get, kwargs, tensors)
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    return getattr(transformers, config_cls)(**kwargs)


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The HF parameter name of a llama.cpp tensor name in a file of `arch`, None for tensors
    to skip."""
    m = _EXPERT.fullmatch(gguf_name)
    if m is not None:
        block, proj, expert = m.groups()
        return f"model.layers.{block}.mlp.experts.{expert}.{proj}_proj.weight"
    m = _NAME.fullmatch(gguf_name)
    if m is not None:
        block, base, suffix = m.groups()
        if block is None and base in TOP:
            return f"{TOP[base]}.{suffix}"
        if block is not None and base in BLOCKS[arch]:
            return f"model.layers.{block}.{BLOCKS[arch][base]}.{suffix}"
        if base in IGNORED:
            return None
    if gguf_name.startswith(SKIPPED_PREFIXES.get(arch, ())):
        return None
    raise ModelLoadError(f"unknown GGUF tensor {_show(gguf_name)}")


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo convert_hf_to_gguf's q/k row permutation (rotary halves interleaved per head)."""
    return (
        w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def iter_gguf(
    path: str, config: Any, progress: bool = True, keep: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The file's tensors dequantized to float32, HF-named; `keep`: which names to read (the
    others are not dequantized)."""
    from gguf.quants import dequantize
    from tqdm.auto import tqdm

    reader = _reader(path)
    arch = _architecture(reader)
    permute, shift = arch in PERMUTED_QK, NORM_SHIFT.get(arch, 0.0)
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    for t in tqdm(reader.tensors, desc="Dequantizing GGUF", unit="tensor", disable=not progress):
        name = hf_name(t.name, arch)
        if name is None or (keep is not None and not keep(name)):
            continue
        try:
            w = dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise ModelLoadError(f"GGUF tensor type {t.tensor_type.name} unsupported: {e}") from e
        w = np.asarray(w, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])
        (w,) = _unpermuted(name, permute, heads, w)
        if shift and name.endswith("norm.weight"):
            w = w - np.float32(shift)
        if "*" in name:  # stacked experts [E, ...]: one HF tensor each
            for e in range(w.shape[0]):
                yield name.replace("*", str(e)), torch.from_numpy(w[e].copy())
            continue
        if not (w.flags.writeable and w.flags.c_contiguous):
            w = w.copy()  # memory-mapped F32 tensors are read-only views of the file
        yield name, torch.from_numpy(w)


# Block layouts of llama.cpp's formats, 32 weights each: fp16 scale d (and, for Q4_1, fp16
# minimum m), then the codes: Q4_0/Q4_1 16 bytes, element j the low nibble of byte j and
# element j+16 the high one; Q8_0 32 signed bytes.
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}  # 32 weights per block
# K-quants whose sub-blocks are 32 weights: super-blocks of 256 with fp16 d and dmin, twelve
# bytes of 6-bit scales sc and mins mn for the 8 sub-blocks (weight = d sc q - dmin mn), then
# Q5_K's 32 bytes of fifth bits and the 128 bytes of low nibbles (sub-block 2j in the low
# nibbles of bytes 32j..32j+31, 2j+1 in their high ones).
_SUPER_BYTES = {"Q4_K": 144, "Q5_K": 176}
# Q6_K: super-blocks of 256 with sixteen sub-blocks of 16: 128 bytes of low nibbles ql, 64 of
# high bit pairs qh, 16 int8 scales sc, fp16 d; weight = d sc (q - 32), q unsigned 6-bit.
_Q6_K_BYTES = 210


def iter_gguf_blocks(
    path: str, config: Any
) -> Iterator[tuple[str, np.ndarray, np.ndarray, np.ndarray]]:
    """The Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K tensors as they are stored: (HF name,
    unsigned codes uint8 [N, K], d float32 [N, G], m float32 [N, G]) with weight = code * d + m
    per group of K / G columns: blocks of 32 (Q4_0: m = -8 d; Q8_0: code = q + 128,
    m = -128 d; Q4_K / Q5_K: each sub-block's d = d sc and m = -dmin mn, exact in float32,
    5-bit codes for Q5_K), Q6_K's sub-blocks of 16 (d = d sc, exact; 6-bit codes, m = -32 d);
    q/k rows un-permuted like iter_gguf's. Other tensor types (Q3_K, Q2_K, ...) are
    skipped."""
    reader = _reader(path)
    arch = _architecture(reader)
    permute = arch in PERMUTED_QK
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    for t in reader.tensors:
        kind = t.tensor_type.name
        known = kind in _BLOCK_BYTES or kind in _SUPER_BYTES or kind == "Q6_K"
        if not known or len(t.shape) != 2:  # matrices only (norms: iter_gguf)
            continue
        name = hf_name(t.name, arch)
        if name is None or "*" in name:  # stacked experts stay dense
            continue
        k, n = (int(x) for x in t.shape)
        raw = np.asarray(t.data)
        if kind == "Q6_K":
            codes, d, m = q6_k_blocks(raw.reshape(n, k // 256, _Q6_K_BYTES))
        elif kind in _SUPER_BYTES:
            codes, d, m = k_quant_blocks(raw.reshape(n, k // 256, _SUPER_BYTES[kind]), kind)
        else:
            codes, d, m = small_blocks(raw.reshape(n, k // 32, _BLOCK_BYTES[kind]), kind)
        yield name, *_unpermuted(name, permute, heads, codes.reshape(n, k), d, m)


def small_blocks(blocks: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_0 / Q4_1 / Q8_0 blocks [N, K/32, bytes] as (codes [N, K/32, 32] uint8, d and m
    [N, K/32] float32) with weight = code * d + m."""
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q8_0":
        codes = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return codes, d, -128.0 * d
    if kind == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    else:
        m = -8.0 * d
    qs = blocks[..., -16:]
    return np.concatenate((qs & 0x0F, qs >> 4), axis=-1), d, m


def _unpermuted(
    name: str, permute: bool, heads: dict[str, int], *arrays: np.ndarray
) -> tuple[np.ndarray, ...]:
    """The arrays with q/k rows un-permuted where the file permuted them, contiguous."""
    proj = name.split(".")[-2]
    if permute and proj in heads:
        arrays = tuple(unpermute(a, heads[proj]) for a in arrays)
    return tuple(np.ascontiguousarray(a) for a in arrays)


def k_quant_blocks(sb: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K / Q5_K super-blocks [N, K/256, bytes] as (codes [N, K/256, 8, 32] uint8, d and m
    [N, K/32] float32) with weight = code * d + m per sub-block of 32 (gguf-py's dequantize
    arithmetic: d sc and dmin mn are exact float32 products)."""
    n, nsb = sb.shape[:2]
    d = sb[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    dmin = sb[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    lo, mid, hi = sb[..., 4:8], sb[..., 8:12], sb[..., 12:16]  # the 12 bytes of 6-bit pairs
    sc = np.concatenate((lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)), axis=-1)
    mn = np.concatenate((mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)), axis=-1)
    qs = sb[..., -128:].reshape(n, nsb, 4, 1, 32) >> np.array([0, 4], np.uint8)[:, None]
    codes = (qs & 0x0F).reshape(n, nsb, 8, 32)
    if kind == "Q5_K":  # sub-block i's fifth bits: bit i of the 32 qh bytes
        qh = sb[..., 16:48].reshape(n, nsb, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]
        codes = codes | ((qh & 1) << 4)
    scale = (d[..., None] * sc.astype(np.float32)).reshape(n, nsb * 8)
    low = (-(dmin[..., None] * mn.astype(np.float32))).reshape(n, nsb * 8)
    return codes, scale, low


def q6_k_blocks(sb: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q6_K super-blocks [N, K/256, 210] as (codes [N, K/256, 256] uint8 in 0..63, d and m
    [N, K/16] float32) with weight = code * d + m = (code - 32) * d per sub-block of 16
    (gguf-py's dequantize arithmetic: d sc an exact float32 product, m = -32 d). Each half of
    128 weights: weight j's low nibble in byte j % 64 of its 64 ql bytes (high nibbles from
    64), its two high bits at bit 2 (j // 32) of byte j % 32 of its 32 qh bytes."""
    n, nsb = sb.shape[:2]
    ql = sb[..., :128].reshape(n, nsb, 2, 1, 64) >> np.array([0, 4], np.uint8)[:, None]
    qh = sb[..., 128:192].reshape(n, nsb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
    codes = (ql & 0x0F).reshape(n, nsb, 256) | ((qh & 0x03) << 4).reshape(n, nsb, 256)
    sc = sb[..., 192:208].view(np.int8).astype(np.float32)
    d = sb[..., 208:210].copy().view(np.float16)[..., 0].astype(np.float32)
    scale = (d[..., None] * sc).reshape(n, nsb * 16)
    return codes, scale, np.float32(-32.0) * scale
