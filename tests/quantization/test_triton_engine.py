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


def use_platform(monkeypatch, platform: CpuPlatform) -> None:
    """Engines built from here on run on `platform`."""
    for where in ("paged.engine.core", "paged.worker.worker"):
        monkeypatch.setattr(f"{where}.select_platform", lambda name=None: platform)


@pytest.fixture
def triton_linears(monkeypatch):
    use_platform(monkeypatch, TritonLinearsOnCpu())


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


def test_int4_split_gemv_in_the_engine(int4_models, monkeypatch):
    """Every int4 linear on the split-K GEMV for one-row inputs (as if start-up timing chose it
    for every shape, paged_cuda.int4_select): the decode steps run it, the prefill the GEMM,
    and greedy output equals HF's on the dequantized model."""
    from paged.kernels import int4_gemv
    from paged.quantization.base import QuantLinear

    class SplitInt4OnCpu(TritonLinearsOnCpu):
        name = "int4-split-on-cpu"

        def prepare_model(self, model, config, source=None) -> None:
            super().prepare_model(model, config, source)
            counters = torch.zeros(64, dtype=torch.int32)
            for mod in model.modules():
                if isinstance(mod, QuantLinear):
                    mod.forward = int4_gemv.Int4SplitGemv(mod, (16, 64, 3, 4), counters)

    use_platform(monkeypatch, SplitInt4OnCpu())
    rows = []
    real = int4_gemv.int4_gemv_split
    monkeypatch.setattr(int4_gemv, "int4_gemv_split", lambda x, *a: rows.append(len(x))
                        or real(x, *a))  # fmt: skip
    llm = LLM(int4_models["awq"], dtype="float32", kv_cache_memory="16MiB")
    prompt = list(range(3, 40, 3))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    got = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    hf = tf.AutoModelForCausalLM.from_pretrained(int4_models["awq-ref"], dtype=torch.float32)
    assert got == hf_greedy(hf.eval(), prompt, 6)
    layers = len(llm.engine.runner.model.layers)
    assert len(rows) == 5 * 4 * layers and set(rows) == {1}  # 5 decode steps, 4 linears a layer
