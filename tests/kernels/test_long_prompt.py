"""A prompt of many prefill chunks through the GPU plugins' Triton attention backend and fused
ops (interpreted on CPU), then decode over the long context: greedy tokens must equal HF's.
The H200 runs the same case in bench/gpu_check.py (long prompts of several chunks)."""

from __future__ import annotations

import pytest
import torch

from paged import LLM, SamplingParams
from paged.kernels.backend import TritonAttentionBackend
from paged_cpu.platform import CpuPlatform


class TritonOnCpu(CpuPlatform):
    name = "triton-on-cpu"

    def attention_backend(self):
        return TritonAttentionBackend

    def ops(self):
        from paged.kernels.ops import triton_fused_ops

        return triton_fused_ops()

    def prepare_model(self, model, config, source=None) -> None:
        pass  # plain torch linears: no CPU weight packing


@pytest.mark.parametrize(
    "overlap", [False, pytest.param(True, marks=pytest.mark.slow)]  # 13 s more: long checks
)
def test_prompt_of_many_chunks_matches_hf(tiny_models, engines_on, overlap, interpreter_only):
    from transformers import AutoModelForCausalLM

    path = tiny_models["llama"]
    engines_on(TritonOnCpu())
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 320, (n,), generator=gen).tolist() for n in (203, 77)]
    llm = LLM(path, dtype="float32", max_model_len=512, max_num_batched_tokens=48,
              num_kv_blocks=64, async_scheduling=overlap)  # fmt: skip
    assert llm.engine.runner.backend.name == "triton"
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for p, g in zip(prompts, got):
        ids = torch.tensor([p])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                          do_sample=False, pad_token_id=0)[0, len(p):].tolist()  # fmt: skip
        assert g == ref
