"""The GPU platforms' quantized linears inside the engine: the CPU platform with the Triton
fp8 / int4 ops of paged.kernels.ops (interpreted), as a GPU plugin installs them."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from quant_ckpt import hf_logprobs, prompt_logprob_drift
from test_fp8 import MATCH, PROMPT
from test_hf_parity import hf_greedy

from paged import LLM, SamplingParams
from paged_cpu.platform import CpuPlatform


class TritonLinearsOnCpu(CpuPlatform):
    name = "triton-linears-on-cpu"

    def ops(self):
        from paged.kernels.ops import triton_fused_ops

        table = triton_fused_ops()
        return {k: table[k] for k in ("fp8_linear", "int4_linear")}


@pytest.fixture
def triton_linears(monkeypatch):
    for where in ("paged.engine.core", "paged.worker.worker"):
        monkeypatch.setattr(f"{where}.select_platform", lambda name=None: TritonLinearsOnCpu())


def test_fp8_triton_gemm_in_the_engine(tiny_models, triton_linears):
    path = tiny_models["llama"]
    llm = LLM(path, dtype="float32", kv_cache_memory="16MiB", quantization="fp8")
    assert prompt_logprob_drift(llm, PROMPT, hf_logprobs(path, PROMPT, fp8="channel")) < MATCH


def test_int4_triton_gemm_and_gemv_in_the_engine(int4_models, triton_linears):
    llm = LLM(int4_models["gptq"], dtype="float32", kv_cache_memory="16MiB")
    prompt = list(range(3, 40, 3))  # prefill: the GEMM; decode steps: the GEMV
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    hf = tf.AutoModelForCausalLM.from_pretrained(int4_models["gptq-ref"], dtype=torch.float32)
    assert got == hf_greedy(hf.eval(), prompt, 8)
