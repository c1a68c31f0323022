"""Tiny quantized checkpoints for the tests: a float HF model's projections rewritten in a
quantized layout (tensors and quantization_config as the publishers lay them out)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
import transformers as tf
from safetensors.torch import load_file, save_file
from tiny_hf import spread_weights

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def is_proj(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in PROJ and ".layers." in name


def rewrite(src: str, dst: str, quant: Callable[[str, torch.Tensor], dict[str, torch.Tensor]],
            qconfig: dict) -> dict[str, torch.Tensor]:  # fmt: skip
    """Copy the model at `src` to `dst` with each projection weight replaced by
    quant(prefix, weight) (suffix -> tensor) and `qconfig` as config.json's
    quantization_config. Returns the float tensors the quantized ones stand for (the
    dequantized weights, by name), for a reference model."""
    d = Path(dst)
    d.mkdir(parents=True)
    for f in Path(src).iterdir():
        if f.suffix != ".safetensors":
            (d / f.name).write_bytes(f.read_bytes())
    tensors, ref = load_file(str(Path(src) / "model.safetensors")), {}
    out = {}
    for name, t in tensors.items():
        if not is_proj(name):
            out[name] = t
            continue
        prefix = name.removesuffix(".weight")
        parts = quant(prefix, t)
        ref[name] = parts.pop("_dequantized")
        out.update({f"{prefix}.{k}": v.contiguous() for k, v in parts.items()})
    save_file(out, str(d / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = qconfig
    (d / "config.json").write_text(json.dumps(cfg))
    return ref


def dequantized_model(src: str, dst: str, ref: dict[str, torch.Tensor]) -> str:
    """The model at `src` with the projection weights `ref` (float32): the reference."""
    d = Path(dst)
    d.mkdir(parents=True)
    for f in Path(src).iterdir():
        if f.suffix != ".safetensors":
            (d / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(Path(src) / "model.safetensors"))
    tensors.update(ref)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    return dst


def hf_logprobs(path: str, prompt: list[int], fp8: str | None = None) -> torch.Tensor:
    """[len - 1, vocab] float32 log-probabilities of HF's forward (row j predicts token j+1).
    `fp8`: the projections' inputs quantized to fp8 per token, as paged's fp8 linears do,
    with the weights as loaded ("as-is": the checkpoint's dequantized values) or quantized
    per output channel first ("channel": what --quantization fp8 does at load)."""
    import transformers as tf

    from paged.quantization.reference import quantize_fp8_rows

    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, m in hf.named_modules():
            fused = ("qkv_proj", "gate_up_proj")  # Phi-3's, quantized as one layer as paged does
            if fp8 is None or name.rpartition(".")[2] not in PROJ + fused or "experts" in name:
                continue
            w = m.weight.float()
            if fp8 == "channel":
                q, s = quantize_fp8_rows(w)
                w = q.float() * s

            def forward(x, w=w, bias=m.bias):
                qx, sx = quantize_fp8_rows(x.reshape(-1, x.shape[-1]))
                y = ((qx.float() @ w.t()) * sx).view(*x.shape[:-1], -1)
                return y if bias is None else y + bias

            m.forward = forward
        return hf(torch.tensor([prompt])).logits[0, :-1].log_softmax(-1)


def prompt_logprob_drift(llm, prompt: list[int], want: torch.Tensor) -> float:
    """Largest |logprob| difference of each prompt token between paged and `want`."""
    from paged import SamplingParams

    out = llm.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    lps = out[0].prompt_logprobs
    return max(abs(e[t].logprob - want[j, t].item()) for j, (t, e) in
               enumerate(zip(prompt[1:], lps[1:])))  # fmt: skip


# ---- int4: AWQ / GPTQ packed as AutoAWQ / AutoGPTQ pack ------------------------------
GROUP = 128
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's pack: nibble i holds column 8c + order[i]


def tiny_int4_llama(path: str) -> str:
    """A tiny Llama whose projections have 256 or 512 input columns (groups of 128; two
    tensor-parallel ranks get whole groups of the row-parallel o_proj and down_proj)."""
    from tiny_hf import make_tiny

    return make_tiny("llama", path, hidden_size=256, intermediate_size=512,
                     max_position_embeddings=256)  # fmt: skip


def _pack_awq(values: torch.Tensor) -> torch.Tensor:
    """[R, C] ints in 0..15 -> int32 [R, C/8], AutoAWQ's interleaved order."""
    r, c = values.shape
    out = torch.zeros(r, c // 8, dtype=torch.int64)
    for col in range(c // 8):
        for i, order in enumerate(AWQ_ORDER):
            out[:, col] |= values[:, col * 8 + order].long() << (4 * i)
    return out.to(torch.int32)  # wraps past 2^31 as int32 storage does


def _pack_rows(values: torch.Tensor) -> torch.Tensor:
    """[R, C] -> int32 [R/8, C]: AutoGPTQ's qweight, 8 consecutive rows per word."""
    r, c = values.shape
    out = torch.zeros(r // 8, c, dtype=torch.int64)
    for j in range(8):
        out |= values[j::8].long() << (4 * j)
    return out.to(torch.int32)


def _pack_cols(values: torch.Tensor) -> torch.Tensor:
    """[R, C] -> int32 [R, C/8]: AutoGPTQ's qzeros, 8 consecutive columns per word."""
    return _pack_rows(values.t().contiguous()).t().contiguous()


def quant_int4(kind: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)

    def quant(prefix: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
        n, k = w.shape
        q = torch.randint(0, 16, (k, n), generator=g)  # [in, out] as both libraries hold it
        if kind == "awq":  # asymmetric: a zero point per group and column
            zeros = torch.randint(0, 16, (k // GROUP, n), generator=g)
        else:  # GPTQ sym=True: zero 8, stored minus one
            zeros = torch.full((k // GROUP, n), 8)
        scales = (torch.rand(k // GROUP, n, generator=g) * 0.03 + 0.02).half()
        deq = (q - zeros.repeat_interleave(GROUP, 0)).float() * scales.float().repeat_interleave(
            GROUP, 0
        )
        parts = {"scales": scales, "_dequantized": deq.t().contiguous()}
        if kind == "awq":
            parts |= {"qweight": _pack_awq(q), "qzeros": _pack_awq(zeros)}
        else:
            parts |= {"qweight": _pack_rows(q), "qzeros": _pack_cols(zeros - 1),
                      "g_idx": torch.arange(k, dtype=torch.int32) // GROUP}  # fmt: skip
        return parts

    return quant


QCONFIG = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
            "version": "gemm"},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False,
             "sym": True, "checkpoint_format": "gptq"},
}  # fmt: skip


def tiny_arch(kind: str, path: str) -> str:
    """A tiny random HF model of another architecture (phi3: fused qkv/gate_up in the file;
    gemma2; qwen3_moe: experts in layer 1) saved to `path`."""
    base = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=320, max_position_embeddings=256,
                eos_token_id=1, bos_token_id=0, pad_token_id=0)  # fmt: skip
    if kind == "phi3":
        cfg = tf.Phi3Config(**base, intermediate_size=128)
    elif kind == "gemma2":
        cfg = tf.Gemma2Config(**base, intermediate_size=128, head_dim=16,
                              query_pre_attn_scalar=16)  # fmt: skip
    else:
        cfg = tf.Qwen3MoeConfig(**base, intermediate_size=96, moe_intermediate_size=48,
                                num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0],
                                head_dim=16)  # fmt: skip
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    spread_weights(model)
    model.save_pretrained(path, safe_serialization=True)
    return path


# ---- GGUF: a tiny Llama as llama.cpp writes it, projections in Q4_0 / Q4_1 -----------------
_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
         "post_attention_layernorm": "ffn_norm"}  # fmt: skip


def _permute(w, n_head: int):
    """llama.cpp's q/k row order (convert_hf_to_gguf's permute)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_q4_gguf(hf_dir: str, out: str, q8: bool = False) -> str:
    """The HF Llama at `hf_dir` as a GGUF file: attention projections Q4_0, MLP ones Q4_1
    (gguf-py's quantizers), the rest float32. `q8`: attention projections and the MLP's gate
    Q8_0 instead (so the stacked gate/up mixes a Q8_0 and a Q4_1 piece)."""
    import gguf
    import numpy as np

    model = tf.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    c = model.config
    w = gguf.GGUFWriter(out, "llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    for name, t in model.state_dict().items():
        a = t.numpy().astype(np.float32)
        parts = name.split(".")
        if parts[1] == "layers":
            gname = f"blk.{parts[2]}.{_GGUF['.'.join(parts[3:-1])]}.{parts[-1]}"
        else:
            gname = {"model.embed_tokens.weight": "token_embd.weight",
                     "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}[name]  # fmt: skip
        if ".attn_q." in gname:
            a = _permute(a, c.num_attention_heads)
        if ".attn_k." in gname:
            a = _permute(a, c.num_key_value_heads)
        kind = None
        if parts[1] == "layers" and "norm" not in gname:
            q = gguf.GGMLQuantizationType
            if q8 and ("attn" in gname or "ffn_gate" in gname):
                kind = q.Q8_0
            else:
                kind = q.Q4_0 if "attn" in gname else q.Q4_1
        if kind is None:
            w.add_tensor(gname, a)
        else:
            w.add_tensor(gname, gguf.quants.quantize(a, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def write_k_gguf(out: str, seed: int = 0) -> str:
    """A tiny Llama GGUF (hidden 256: K-quants need K a multiple of 256) whose projections are
    random but valid K-quant super-blocks, mixed as in a Q4_K_M file: attention and down Q4_K,
    gate/up Q5_K, but the last layer's attn_v and ffn_down and the output head Q6_K (gguf-py
    has no K-quantizer; the dense load dequantizes the same bytes). Embedding and norms
    float32; no tokenizer (token-id prompts)."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    hidden, inter, heads, kv, layers, vocab = 256, 512, 4, 2, 2, 512
    w = gguf.GGUFWriter(out, "llama")
    w.add_block_count(layers)
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_rope_dimension_count(hidden // heads)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    q = gguf.GGMLQuantizationType

    def k_quant(n: int, k: int, kind) -> np.ndarray:
        size = {q.Q4_K: 144, q.Q5_K: 176, q.Q6_K: 210}[kind]
        raw = rng.integers(0, 256, (n, k // 256, size), dtype=np.uint8)
        if kind == q.Q6_K:  # fp16 d last (the sc are random int8): weights' spread as Q4_K's
            d = rng.uniform(2e-5, 8e-5, (n, k // 256, 1)).astype(np.float16)
            raw[..., 208:] = d.view(np.uint8)
        else:
            scale = rng.uniform(5e-5, 4e-4, (n, k // 256, 2)).astype(np.float16)  # d, dmin
            raw[..., :4] = scale.view(np.uint8).reshape(n, k // 256, 4)
        return raw.reshape(n, -1)

    hd = hidden // heads
    shapes = {"attn_q": (heads * hd, hidden), "attn_k": (kv * hd, hidden),
              "attn_v": (kv * hd, hidden), "attn_output": (hidden, heads * hd),
              "ffn_gate": (inter, hidden), "ffn_up": (inter, hidden),
              "ffn_down": (hidden, inter)}  # fmt: skip
    w.add_tensor("token_embd.weight", rng.normal(0, 0.5, (vocab, hidden)).astype(np.float32))
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    w.add_tensor("output.weight", k_quant(vocab, hidden, q.Q6_K), raw_dtype=q.Q6_K)
    for b in range(layers):
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{b}.{norm}.weight", rng.uniform(0.8, 1.2, hidden).astype(np.float32))
        for name, (n, k) in shapes.items():
            kind = q.Q5_K if name in ("ffn_gate", "ffn_up") else q.Q4_K
            if b == layers - 1 and name in ("attn_v", "ffn_down"):
                kind = q.Q6_K
            w.add_tensor(f"blk.{b}.{name}.weight", k_quant(n, k, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
