"""A GGUF file of random quantized blocks in a named shape (model/shapes.py), for benchmarks of
the GGUF paths where no real file can be had (the GPU machine downloads nothing).

    python bench/synthetic_gguf.py --shape llama-3.1-8b --type Q4_0 --out /tmp/8b-q4_0.gguf
    paged bench latency --model /tmp/8b-q4_0.gguf --batch-size 1 --input-len 128 --output-len 64

Every linear, the embedding and the head are blocks of --type (Q4_0, Q4_1, Q8_0, Q4_K or Q6_K:
random codes, scales chosen so the weights have a standard deviation near 0.02 and mean near
0), or Q4_K_M, llama.cpp's usual mix: Q4_K, with Q6_K for the head and for attn_v and ffn_down
in llama.cpp's "more bits" layers (the first and last eighth, every third between); K types
need rows of whole super-blocks of 256 weights (Q8_0 where not); the norms are ones in
float32. The tokenizer is GPT-2's byte-level BPE with every byte a token and one merge (bytes
0 and 1), the rest of the vocabulary filler: enough to turn any text into ids, in paged and in
llama.cpp. The figures are about the weights.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "core"))

from paged.model.shapes import SHAPES  # noqa: E402

STD = 0.02
# weights a block, bytes a block, and the code's standard deviation (uniform codes)
LAYOUTS = {"Q4_0": (32, 18, 4.61), "Q4_1": (32, 20, 4.61), "Q8_0": (32, 34, 73.9),
           "Q4_K": (256, 144, 4.61), "Q6_K": (256, 210, 18.5)}  # fmt: skip
MIXES = {"Q4_K_M"}
SUB_SCALE = 8  # Q4_K's 6-bit sub-block scale and min, and Q6_K's int8 sub-block scale / 2


def _f16(x: float) -> np.ndarray:
    return np.frombuffer(np.float16(x).tobytes(), np.uint8)


def blocks(rng: np.random.Generator, rows: int, cols: int, kind: str) -> np.ndarray:
    """[rows, cols / block * bytes] uint8 in the type's layout: random codes; each block's
    float16 scale (and Q4_1's min), Q4_K's and Q6_K's sub-block scales all alike."""
    n, size, code_std = LAYOUTS[kind]
    out = rng.integers(0, 256, (rows, cols // n, size), dtype=np.uint8)
    if kind == "Q4_K":  # d, dmin, 12 bytes of 6-bit scales and mins, codes: w = d sc q - dmin mn
        d = STD / (code_std * SUB_SCALE)
        out[..., 0:2], out[..., 2:4] = _f16(d), _f16(7.5 * d)  # dmin mn centres the codes
        out[..., 4:12] = SUB_SCALE  # sub-blocks 0-3: scale, then min, in the low 6 bits
        out[..., 12:16] = SUB_SCALE | SUB_SCALE << 4  # sub-blocks 4-7: low 4 bits of each
    elif kind == "Q6_K":  # ql, qh, 16 int8 sub-block scales, d: w = d sc (q - 32)
        out[..., 192:208] = 2 * SUB_SCALE
        out[..., 208:210] = _f16(STD / (code_std * 2 * SUB_SCALE))
    else:
        d = np.float16(STD / code_std)
        out[..., 0:2] = _f16(d)
        if kind == "Q4_1":  # w = code * d + m: m = -8 d centres the codes as Q4_0 does
            out[..., 2:4] = _f16(-8 * d)
    return out.reshape(rows, -1)


def tensor_kind(name: str, cols: int, kind: str, layers: int) -> str:
    """The type of tensor `name` (`cols` weights a row) in a file of --type `kind`: a mix as
    llama.cpp chooses; a K type where rows do not split into super-blocks of 256 falls back to
    Q8_0 (llama.cpp: Q5_0 or Q8_0)."""
    if kind == "Q4_K_M":
        kind = "Q4_K"
        if name == "output.weight":
            kind = "Q6_K"
        elif name.endswith(("attn_v.weight", "ffn_down.weight")):
            i = int(name.split(".")[1])  # llama.cpp's use_more_bits
            if i < layers // 8 or i >= 7 * layers // 8 or (i - layers // 8) % 3 == 2:
                kind = "Q6_K"
    return "Q8_0" if cols % LAYOUTS[kind][0] else kind


def tensors(cfg: dict) -> list[tuple[str, tuple[int, int] | tuple[int]]]:
    """llama.cpp's tensor names and [rows, cols] shapes for a Llama-architecture shape."""
    h, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    out: list = [("token_embd.weight", (v, h))]
    for i in range(cfg["num_hidden_layers"]):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (h,)), (b + "attn_q.weight", (q, h)),
                (b + "attn_k.weight", (kv, h)), (b + "attn_v.weight", (kv, h)),
                (b + "attn_output.weight", (h, q)), (b + "ffn_norm.weight", (h,)),
                (b + "ffn_gate.weight", (f, h)), (b + "ffn_up.weight", (f, h)),
                (b + "ffn_down.weight", (h, f))]  # fmt: skip
    if cfg.get("rope_scaling"):
        out.append(("rope_freqs.weight", (hd // 2,)))
    out.append(("output_norm.weight", (h,)))
    if not cfg.get("tie_word_embeddings"):
        out.append(("output.weight", (v, h)))
    return out


def byte_level_alphabet() -> list[str]:
    """GPT-2's byte-level BPE alphabet: byte b as a printable character (the printable
    Latin-1 bytes as themselves, the others from U+0100 on), in byte order."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def rope_factors(cfg: dict) -> np.ndarray:
    """Llama 3's rope scaling as the divisors of each frequency that convert_hf_to_gguf.py
    bakes into rope_freqs.weight."""
    rs = cfg["rope_scaling"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    orig = rs["original_max_position_embeddings"]
    freqs = cfg["rope_theta"] ** -(np.arange(0, d, 2, dtype=np.float64) / d)
    wavelen = 2 * np.pi / freqs
    smooth = (orig / wavelen - low) / (high - low)
    out = 1 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen < orig / high, 1.0, np.where(wavelen > orig / low, factor, out))
    return out.astype(np.float32)


def write(shape: str, kind: str, path: str, seed: int = 0, layers: int | None = None) -> Path:
    import gguf

    cfg = dict(SHAPES[shape])
    if layers:
        cfg["num_hidden_layers"] = layers
    if cfg.get("architecture", "LlamaForCausalLM") != "LlamaForCausalLM":
        raise SystemExit(f"--shape: {shape} is not a Llama-architecture shape")
    w = gguf.GGUFWriter(path, "llama")
    w.add_name(f"{shape}-synthetic-{kind.lower()}")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(min(cfg["max_position_embeddings"], 131072))
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    if cfg.get("head_dim"):
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    v = cfg["vocab_size"]
    byte_tokens = byte_level_alphabet()
    w.add_tokenizer_model("gpt2")
    # one merge, of bytes 0 and 1 (llama.cpp refuses a BPE vocabulary without merges)
    pair = byte_tokens[0] + byte_tokens[1]
    w.add_token_list(byte_tokens + [pair] + [f"<filler{i}>" for i in range(v - 257)])
    w.add_token_types([1] * v)
    w.add_token_scores([0.0] * v)
    w.add_token_merges([f"{byte_tokens[0]} {byte_tokens[1]}"])
    eos = cfg.get("eos_token_id")
    w.add_bos_token_id(cfg.get("bos_token_id") or 1)
    w.add_eos_token_id((eos[0] if isinstance(eos, list) else eos) or 2)
    shapes = tensors(cfg)
    for name, shp in shapes:
        if len(shp) == 1:
            w.add_tensor_info(name, shp, np.dtype(np.float32), shp[0] * 4)
        else:
            rows, cols = shp
            t = tensor_kind(name, cols, kind, cfg["num_hidden_layers"])
            nbytes = rows * cols // LAYOUTS[t][0] * LAYOUTS[t][1]
            w.add_tensor_info(name, (rows, nbytes // rows), np.dtype(np.uint8), nbytes,
                              getattr(gguf.GGMLQuantizationType, t))  # fmt: skip
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, shp in shapes:
        if name == "rope_freqs.weight":
            w.write_tensor_data(rope_factors(cfg))
        elif len(shp) == 1:
            w.write_tensor_data(np.ones(shp, np.float32))
        else:
            t = tensor_kind(name, shp[1], kind, cfg["num_hidden_layers"])
            w.write_tensor_data(blocks(rng, shp[0], shp[1], t))
    w.close()
    return Path(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shape", default="llama-3.1-8b", help=", ".join(SHAPES))
    ap.add_argument("--type", default="Q4_0", choices=sorted([*LAYOUTS, *MIXES]))
    ap.add_argument("--out", required=True, help="the .gguf file to write")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, help="fewer layers than the shape has (a quick check)")
    a = ap.parse_args()
    p = write(a.shape, a.type, a.out, a.seed, a.layers)
    print(f"{p}: {p.stat().st_size / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
