"""AWQ and GPTQ int4 checkpoints (group size 128) packed here as AutoAWQ / AutoGPTQ pack them,
loaded on CPU: greedy output token-identical to HF transformers on the dequantized float
model in float32; refusals of what is not supported, by name."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf
from quant_ckpt import dequantized_model, hf_greedy, rewrite

from paged import LLM, SamplingParams
from paged.quantization import QuantLinear

GROUP = 128
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's pack: nibble i holds column 8c + order[i]


def _tiny_int4(path: str) -> str:
    """A tiny Llama whose projections have 256 or 512 input columns (groups of 128; two
    tensor-parallel ranks get whole groups of the row-parallel o_proj and down_proj)."""
    cfg = tf.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=320,
                         max_position_embeddings=256, eos_token_id=1, bos_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return path


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


def _quant(kind: str, seed: int = 0):
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


@pytest.fixture(scope="module")
def int4_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("int4")
    src = _tiny_int4(str(root / "float"))
    out = {}
    for kind in ("awq", "gptq"):
        ref = rewrite(src, str(root / kind), _quant(kind), QCONFIG[kind])
        out[kind] = str(root / kind)
        out[f"{kind}-ref"] = dequantized_model(src, str(root / f"{kind}-ref"), ref)
    return out


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
