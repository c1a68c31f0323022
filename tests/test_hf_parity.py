"""Greedy output token-identical to HF transformers on the same weights (float32)."""

from __future__ import annotations

import pytest
import torch

from paged import LLM, SamplingParams

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers.",
    "How do I reverse a list in Python?",
    "Tell me a short joke.",
    "What does a CPU do?",
    "Translate 'good morning' into Spanish.",
]


def hf_greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    """HF's own forward with its KV cache, greedy, exactly n tokens (end of sequence ignored)."""
    out, ids = [], torch.tensor([prompt_ids])
    past = None
    with torch.inference_mode():
        for _ in range(n):
            res = model(ids, past_key_values=past, use_cache=True)
            past = res.past_key_values
            tok = int(res.logits[0, -1].argmax())
            out.append(tok)
            ids = torch.tensor([[tok]])
    return out


def hf_greedy_choices(model, prompt_ids: list[int], tokens: list[int]) -> list[int]:
    """HF's greedy choice after the prompt and each prefix of `tokens`, from one forward over
    them: equal to `tokens` exactly when `tokens` is HF's greedy continuation (by induction,
    each token is then what hf_greedy picks next); where they first differ, HF's choice."""
    ids = torch.tensor([prompt_ids + tokens[:-1]])
    with torch.inference_mode():
        logits = model(ids, use_cache=False).logits[0, len(prompt_ids) - 1 :]
    return logits.argmax(-1).tolist()


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_tiny_models_match_hf(tiny_models, kind):
    from transformers import AutoModelForCausalLM

    path = tiny_models[kind]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, dtype="float32", kv_cache_memory="16MiB", max_num_batched_tokens=64)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 320, (n,), generator=g).tolist() for n in (3, 17, 40, 9)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for p, o in zip(prompts, outs, strict=True):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 24)
        assert o.outputs[0].finish_reason == "length"


def test_smollm2_gguf_matches_hf(smollm, hf_smollm):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    convs = [[{"role": "user", "content": c}] for c in CHATS]
    outs = smollm.chat(convs, params, use_tqdm=False)
    assert len(outs) == 8
    for o in outs:
        got = o.outputs[0].token_ids
        ref = hf_greedy_choices(hf_smollm, o.prompt_token_ids, got)  # 40 steps of HF at once
        assert got == ref, (o.prompt, smollm.tokenizer.decode(got), smollm.tokenizer.decode(ref))
        assert o.outputs[0].text.strip()
