"""Tiny quantized checkpoints for the tests: a float HF model's projections rewritten in a
quantized layout (tensors and quantization_config as the publishers lay them out)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

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


def hf_greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    out, ids, past = [], torch.tensor([prompt_ids]), None
    with torch.inference_mode():
        for _ in range(n):
            res = model(ids, past_key_values=past, use_cache=True)
            past = res.past_key_values
            tok = int(res.logits[0, -1].argmax())
            out.append(tok)
            ids = torch.tensor([[tok]])
    return out


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
            if fp8 is None or name.rpartition(".")[2] not in PROJ:
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
