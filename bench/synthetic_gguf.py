"""A GGUF file of random quantized blocks in a named shape (model/shapes.py), for benchmarks of
the GGUF paths where no real file can be had (the GPU machine downloads nothing).

    python bench/synthetic_gguf.py --shape llama-3.1-8b --type Q4_0 --out /tmp/8b-q4_0.gguf
    paged bench latency --model /tmp/8b-q4_0.gguf --batch-size 1 --input-len 128 --output-len 64

Every linear, the embedding and the head are blocks of --type (Q4_0, Q4_1 or Q8_0: random codes,
one scale per block chosen so the weights have a standard deviation near 0.02); the norms are
ones in float32. The tokenizer is GPT-2's byte-level BPE with every byte a token and one
merge (bytes 0 and 1), the rest of the vocabulary filler: enough to turn any text into ids,
in paged and in llama.cpp. The figures are about the weights.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "core"))

from paged.model.shapes import SHAPES  # noqa: E402

BLOCK = 32
STD = 0.02
# bytes per block of 32, and the code's standard deviation (uniform codes)
LAYOUTS = {"Q4_0": (18, 4.61), "Q4_1": (20, 4.61), "Q8_0": (34, 73.9)}


def blocks(rng: np.random.Generator, rows: int, cols: int, kind: str) -> np.ndarray:
    """[rows, cols / 32 * bytes] uint8: each block's float16 scale (and Q4_1's min) then codes."""
    size, code_std = LAYOUTS[kind]
    out = rng.integers(0, 256, (rows, cols // BLOCK, size), dtype=np.uint8)
    d = np.float16(STD / code_std)
    out[..., 0:2] = np.frombuffer(d.tobytes(), np.uint8)
    if kind == "Q4_1":  # w = code * d + m: m = -8 d centres the codes as Q4_0 does
        out[..., 2:4] = np.frombuffer(np.float16(-8 * d).tobytes(), np.uint8)
    return out.reshape(rows, -1)


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
    qtype = getattr(gguf.GGMLQuantizationType, kind)
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
            nbytes = rows * cols // BLOCK * LAYOUTS[kind][0]
            w.add_tensor_info(name, (rows, nbytes // rows), np.dtype(np.uint8), nbytes, qtype)
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
            w.write_tensor_data(blocks(rng, shp[0], shp[1], kind))
    w.close()
    return Path(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shape", default="llama-3.1-8b", help=", ".join(SHAPES))
    ap.add_argument("--type", default="Q4_0", choices=sorted(LAYOUTS))
    ap.add_argument("--out", required=True, help="the .gguf file to write")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, help="fewer layers than the shape has (a quick check)")
    a = ap.parse_args()
    p = write(a.shape, a.type, a.out, a.seed, a.layers)
    print(f"{p}: {p.stat().st_size / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
