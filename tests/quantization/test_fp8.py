"""FP8 weights on CPU (the torch reference path): a float checkpoint quantized at load
(--quantization fp8), transformers' fp8 block layout and compressed-tensors' fp8 layouts
loaded as published; logits close to the float model's (fp8 tolerance, not token-identical)."""

from __future__ import annotations

import pytest
import torch
from quant_ckpt import dequantized_model, hf_logprobs, prompt_logprob_drift, rewrite, tiny_arch

from paged import LLM, SamplingParams
from paged.quantization import QuantLinear
from paged.quantization.reference import FP8, FP8_MAX, dequantize_fp8

PROMPT = [5, 17, 42, 99, 3, 250, 11, 64, 7, 128, 30, 201, 9, 77, 150, 2, 33, 310]
# nats from HF with the same fp8 linears patched in: float32 noise (paged's attention is not
# HF's) flips an activation's fp8 rounding now and then, one step of 6 %; 30x below DRIFT
MATCH = 0.03
DRIFT = 1.0  # nats from the float model: the tiny random model amplifies fp8's rounding


def _llm(path: str, **kw) -> LLM:
    return LLM(path, dtype="float32", kv_cache_memory="16MiB", max_num_batched_tokens=64, **kw)


def _quant_layers(llm: LLM) -> list[QuantLinear]:
    return [m for m in llm.engine.runner.model.modules() if isinstance(m, QuantLinear)]


def test_quantized_at_load_is_close_to_float(tiny_models):
    path = tiny_models["llama"]
    llm = _llm(path, quantization="fp8")
    layers = _quant_layers(llm)
    assert len(layers) == 4 * 2  # qkv, o, gate_up, down in each of 2 layers
    assert all(m.weight.dtype == FP8 and m.weight_scale.shape[1] == 1 for m in layers)
    assert prompt_logprob_drift(llm, PROMPT, hf_logprobs(path, PROMPT, fp8="channel")) < MATCH
    drift = prompt_logprob_drift(llm, PROMPT, hf_logprobs(path, PROMPT))
    assert 0 < drift < DRIFT  # quantized (not exact), but close
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    dense = _llm(path)
    a = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids
    b = dense.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids
    assert len(a) == 16 and a[:4] == b[:4]  # greedy may part later, as fp8 does
    llm.engine.kv.check_invariants()


def _block_quant(block: int):
    """transformers' FineGrainedFP8 layout: weight fp8, weight_scale_inv per block."""

    def quant(prefix: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
        n, k = w.shape
        rows, cols = -(-n // block), -(-k // block)
        padded = torch.zeros(rows * block, cols * block)
        padded[:n, :k] = w
        blocks = padded.view(rows, block, cols, block)
        scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)  # [rows, cols]
        full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:n, :k]
        q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        return {"weight": q, "weight_scale_inv": scale, "_dequantized": q.float() * full}

    return quant


def _ct_quant(strategy: str):
    """compressed-tensors float-quantized: weight fp8, weight_scale per channel / tensor,
    and a static input_scale."""

    def quant(prefix: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
        if strategy == "channel":
            scale = w.abs().amax(1, keepdim=True) / FP8_MAX  # [N, 1]
        else:
            scale = (w.abs().amax() / FP8_MAX).reshape(1)
        q = (w / scale.reshape(-1, 1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        return {"weight": q, "weight_scale": scale, "input_scale": torch.tensor([0.05]),
                "_dequantized": q.float() * scale.reshape(-1, 1)}  # fmt: skip

    return quant


def _ct_config(strategy: str) -> dict:
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": strategy,
                        "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                  "symmetric": True, "dynamic": False},
        }},
        "ignore": ["lm_head"],
    }  # fmt: skip


@pytest.mark.parametrize("layout", ["fp8-block", "ct-channel", "ct-tensor"])
def test_fp8_checkpoints_load_as_published(tiny_models, tmp_path, layout):
    src = tiny_models["llama"]
    if layout == "fp8-block":
        qconfig = {"quant_method": "fp8", "activation_scheme": "dynamic",
                   "weight_block_size": [32, 32]}  # fmt: skip
        ref = rewrite(src, str(tmp_path / "q"), _block_quant(32), qconfig)
    else:
        strategy = layout.split("-")[1]
        ref = rewrite(src, str(tmp_path / "q"), _ct_quant(strategy), _ct_config(strategy))
    llm = _llm(str(tmp_path / "q"))  # the method comes from config.json
    model = llm.engine.runner.model
    # every stacked layer holds exactly the checkpoint's values, its rows in q/k/v order
    for i, layer in enumerate(model.layers):
        pre = f"model.layers.{i}."
        for mod, parts in ((layer.self_attn.qkv_proj, ("q_proj", "k_proj", "v_proj")),
                           (layer.self_attn.o_proj, ("o_proj",)),
                           (layer.mlp.gate_up_proj, ("gate_proj", "up_proj")),
                           (layer.mlp.down_proj, ("down_proj",))):  # fmt: skip
            assert isinstance(mod, QuantLinear) and mod.weight.dtype == FP8
            kind = "self_attn" if parts[0].endswith(("q_proj", "o_proj")) else "mlp"
            kind = "self_attn" if parts[0] in ("q_proj", "k_proj", "v_proj", "o_proj") else kind
            want = torch.cat([ref[f"{pre}{kind}.{p}.weight"] for p in parts])
            got = dequantize_fp8(mod.weight, mod.weight_scale, mod.group_k)
            assert torch.equal(got, want), (i, parts)
    float_dir = dequantized_model(src, str(tmp_path / "ref"), ref)
    assert prompt_logprob_drift(llm, PROMPT, hf_logprobs(float_dir, PROMPT, "as-is")) < MATCH
    assert prompt_logprob_drift(llm, PROMPT, hf_logprobs(float_dir, PROMPT)) < DRIFT


@pytest.mark.parametrize("kind", ["phi3", "gemma2", "qwen3_moe"])
def test_quantized_at_load_other_architectures(tmp_path, kind):
    """Phi-3's fused qkv/gate_up rows quantized before the split, Gemma 2, Qwen3-MoE (its
    attention and dense layer quantized, the experts left in the model dtype)."""
    path = tiny_arch(kind, str(tmp_path / kind))
    llm = _llm(path, quantization="fp8")
    dense_mlps = 1 if kind == "qwen3_moe" else 2
    assert len(_quant_layers(llm)) == 2 * 2 + 2 * dense_mlps
    assert prompt_logprob_drift(llm, PROMPT, hf_logprobs(path, PROMPT, fp8="channel")) < MATCH


def test_quantized_moe_checkpoint_refused(tmp_path):
    path = tiny_arch("qwen3_moe", str(tmp_path / "src"))
    rewrite(path, str(tmp_path / "q"), _ct_quant("channel"), _ct_config("channel"))
    with pytest.raises(ValueError, match="quantized mixture-of-experts checkpoints"):
        _llm(str(tmp_path / "q"))


def test_dummy_weights(tiny_models):
    """--load-format dummy draws random fp8 weights (the GPU benchmarks' path)."""
    llm = _llm(tiny_models["llama"], quantization="fp8", load_format="dummy")
    layers = _quant_layers(llm)
    assert all(m.weight.float().abs().max() > 0 and (m.weight_scale > 0).all() for m in layers)
    out = llm.generate([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_fp8_block_checkpoint_tensor_parallel_shards(tiny_models, tmp_path):
    """Two ranks (gloo) on a 32x32-block fp8 checkpoint: rank 0 (the driver, in this process)
    holds exactly its slices of one rank's tensors: its heads' q/k/v rows and gate/up columns,
    and of o_proj / down_proj its input columns with their blocks' scales."""
    qconfig = {"quant_method": "fp8", "activation_scheme": "dynamic",
               "weight_block_size": [32, 32]}  # fmt: skip
    rewrite(tiny_models["llama"], str(tmp_path / "q"), _block_quant(32), qconfig)
    one = _llm(str(tmp_path / "q")).engine.runner.model.layers[1]
    llm = _llm(str(tmp_path / "q"), tensor_parallel_size=2, max_model_len=128)
    try:
        two = llm.engine.runner.model.layers[1]
        d, q, kv, inter = 16, 64, 32, 128  # head_dim, q rows, k/v rows, MLP columns
        rows = {  # rank 0: query heads 0-1, KV head 0, the first half of the MLP
            "qkv": torch.cat([torch.arange(2 * d), q + torch.arange(d), q + kv + torch.arange(d)]),
            "gate_up": torch.cat([torch.arange(inter // 2), inter + torch.arange(inter // 2)]),
        }  # fmt: skip
        for name, a, b in (("qkv", one.self_attn.qkv_proj, two.self_attn.qkv_proj),
                           ("gate_up", one.mlp.gate_up_proj, two.mlp.gate_up_proj)):  # fmt: skip
            assert torch.equal(b.weight.float(), a.weight.float()[rows[name]])
            assert torch.equal(b.weight_scale, a.weight_scale[rows[name]])
        for a, b, cols in ((one.self_attn.o_proj, two.self_attn.o_proj, 2 * d),
                           (one.mlp.down_proj, two.mlp.down_proj, inter // 2)):  # fmt: skip
            assert torch.equal(b.weight.float(), a.weight.float()[:, :cols])
            assert torch.equal(b.weight_scale, a.weight_scale[:, : cols // 32])
        out = llm.generate(PROMPT, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        llm.engine.shutdown()


def test_quantized_tensor_of_a_dense_layer_refused(tiny_models, tmp_path):
    """A checkpoint that quantizes a layer paged keeps dense (here lm_head) is refused."""
    from safetensors.torch import load_file, save_file

    rewrite(tiny_models["llama"], str(tmp_path / "q"), _ct_quant("channel"), _ct_config("channel"))

    f = str(tmp_path / "q" / "model.safetensors")
    tensors = load_file(f)
    head = tensors.pop("lm_head.weight")
    parts = _ct_quant("channel")("lm_head", head)
    tensors |= {"lm_head.weight": parts["weight"], "lm_head.weight_scale": parts["weight_scale"]}
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="'lm_head.weight_scale' belongs to a layer paged keeps"):
        _llm(str(tmp_path / "q"))
