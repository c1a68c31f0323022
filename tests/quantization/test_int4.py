"""AWQ and GPTQ int4 checkpoints (group size 128) packed here as AutoAWQ / AutoGPTQ pack them,
loaded on CPU: greedy output token-identical to HF transformers on the dequantized float
model in float32; refusals of what is not supported, by name."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf
from quant_ckpt import QCONFIG
from test_hf_parity import hf_greedy

from paged import LLM, SamplingParams
from paged.quantization import QuantLinear


@pytest.mark.parametrize("kind", ["awq", "gptq"])
def test_int4_checkpoint_matches_dequantized_hf(int4_models, kind):
    llm = LLM(int4_models[kind], dtype="float32", kv_cache_memory="16MiB",
              max_num_batched_tokens=32)  # fmt: skip
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 8 and all(m.codes.dtype == torch.int32 for m in layers)
    hf = tf.AutoModelForCausalLM.from_pretrained(int4_models[f"{kind}-ref"], dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 320, (n,), generator=g).tolist() for n in (5, 40)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for p, o in zip(prompts, outs, strict=True):
        assert o.outputs[0].token_ids == hf_greedy(hf.eval(), p, 16)
    llm.engine.kv.check_invariants()


def test_int4_tensor_parallel_matches_dequantized_hf(int4_models):
    """AWQ over two ranks (gloo): column shards of the stacked codes, row shards of o_proj
    and down_proj by whole words and groups; greedy output is still HF's."""
    llm = LLM(int4_models["awq"], dtype="float32", kv_cache_memory="8MiB", tensor_parallel_size=2,
              max_num_batched_tokens=32, max_model_len=128)  # fmt: skip
    try:
        prompt = list(range(3, 40, 3))
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        got = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        llm.engine.shutdown()
    hf = tf.AutoModelForCausalLM.from_pretrained(int4_models["awq-ref"], dtype=torch.float32)
    assert got == hf_greedy(hf.eval(), prompt, 12)


def _with_config(src: str, dst, qconfig: dict) -> str:
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = qconfig
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


@pytest.mark.parametrize("qconfig, message", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes' is not supported"),
    ({**QCONFIG["gptq"], "desc_act": True}, "desc_act"),
    ({**QCONFIG["awq"], "bits": 8}, "8-bit weights"),
    ({**QCONFIG["awq"], "version": "gemv"}, "version 'gemv'"),
])  # fmt: skip
def test_unsupported_checkpoint_methods_refused(int4_models, tmp_path, qconfig, message):
    path = _with_config(int4_models["awq-ref"], tmp_path / "m", qconfig)
    with pytest.raises(ValueError, match=message):
        LLM(path, dtype="float32", kv_cache_memory="16MiB")


def test_quantization_flag_checked_against_checkpoint(int4_models):
    with pytest.raises(ValueError, match="quantization 'int3' is not supported"):
        LLM(int4_models["awq"], quantization="int3")
    with pytest.raises(ValueError, match="checkpoint is quantized as awq"):
        LLM(int4_models["awq"], dtype="float32", quantization="gptq")
    with pytest.raises(ValueError, match="quantization none: the checkpoint is quantized"):
        LLM(int4_models["awq"], dtype="float32", quantization="none")
    with pytest.raises(ValueError, match="quantization awq: the checkpoint has no"):
        LLM(int4_models["awq-ref"], dtype="float32", quantization="awq")
