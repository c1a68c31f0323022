"""HF transformers' greedy output with the K/V every attention reads rounded through fp8 as
paged's fp8 KV cache stores them (paged.model.kv_quant): the reference of the fp8 cache tests."""

from __future__ import annotations

import torch

from paged.model.kv_quant import dequantize, quantize


def hf_greedy_fp8(
    path: str,
    prompts: list[list[int]],
    max_new_tokens: int,
    fp8: torch.dtype | None,
    scales: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> list[list[int]]:
    """Greedy continuations of a float32 HF Llama; `fp8` None: unquantized. `scales`: per layer
    (k_scale, v_scale) `[kv_heads]` (default 1.0)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.llama import modeling_llama

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    model.generation_config.eos_token_id = None  # paged's side ignores EOS
    eager = modeling_llama.eager_attention_forward

    def rounded(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:  # x [B, heads, T, D]
        y = x.transpose(1, 2)  # heads next to the last dim, as quantize expects
        return dequantize(quantize(y, scale, fp8), scale, x.dtype).transpose(1, 2)

    def attention(module, query, key, value, *args, **kwargs):
        ones = torch.ones(key.shape[1])
        ks, vs = (scales or {}).get(module.layer_idx, (ones, ones))
        return eager(module, query, rounded(key, ks), rounded(value, vs), *args, **kwargs)

    if fp8 is not None:
        modeling_llama.eager_attention_forward = attention
    try:
        done: dict[tuple[int, ...], list[int]] = {}
        for p in map(tuple, prompts):
            if p not in done:
                ids = torch.tensor([p])
                gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=max_new_tokens, pad_token_id=0)  # fmt: skip
                done[p] = gen[0, len(p) :].tolist()
        return [done[tuple(p)] for p in prompts]
    finally:
        modeling_llama.eager_attention_forward = eager
