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
def triton_linears(engines_on):
    engines_on(TritonLinearsOnCpu())


def test_fp8_triton_gemm_in_the_engine(tiny_models, triton_linears):
    path = tiny_models["llama"]
    llm = LLM(path, dtype="float32", kv_cache_memory="16MiB", quantization="fp8")
    assert prompt_logprob_drift(llm, PROMPT, hf_logprobs(path, PROMPT, fp8="channel")) < MATCH


@pytest.mark.slow  # 22 s: interpreted Triton through the engine, with the long checks
def test_int4_triton_linears_in_the_engine(int4_models, triton_linears):
    llm = LLM(int4_models["gptq"], dtype="float32", kv_cache_memory="16MiB")
    prompt = list(range(3, 120, 3))  # prefill (39 rows): dequantized; decode: the split GEMM
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    got = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    hf = tf.AutoModelForCausalLM.from_pretrained(int4_models["gptq-ref"], dtype=torch.float32)
    assert got == hf_greedy(hf.eval(), prompt, 4)


@pytest.mark.slow  # 14 s: interpreted Triton through the engine, with the long checks
def test_int4_tuned_gemm_in_the_engine(int4_models, monkeypatch, engines_on):
    """Every int4 linear on a tuned split-GEMM config (as if start-up timing chose one for every
    shape, paged_cuda.int4_select): the decode steps run it, the prefill (13 rows) the split
    GEMM's default config, and greedy output equals HF's on the dequantized model."""
    from paged.kernels import int4_gemm
    from paged.quantization.base import QuantLinear

    config = (16, 64, 128, 2, 4)  # K split: two slices of the 256 / 512 columns

    class TunedInt4OnCpu(TritonLinearsOnCpu):
        name = "int4-tuned-on-cpu"

        def prepare_model(self, model, config_, source=None) -> None:
            super().prepare_model(model, config_, source)
            for mod in model.modules():
                if isinstance(mod, QuantLinear):
                    mod.forward = int4_gemm.Int4TunedGemm(mod, config)

    engines_on(TunedInt4OnCpu())
    rows = []
    real = int4_gemm.int4_gemm_split
    monkeypatch.setattr(int4_gemm, "int4_gemm_split", lambda x, *a: rows.append((len(x), a[-1]))
                        or real(x, *a))  # fmt: skip
    llm = LLM(int4_models["awq"], dtype="float32", kv_cache_memory="16MiB")
    prompt = list(range(3, 40, 3))
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    got = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    hf = tf.AutoModelForCausalLM.from_pretrained(int4_models["awq-ref"], dtype=torch.float32)
    assert got == hf_greedy(hf.eval(), prompt, 3)
    layers = len(llm.engine.runner.model.layers)
    assert rows == [(len(prompt), None)] * 4 * layers + [(1, config)] * 2 * 4 * layers
