"""Qwen3-MoE through the GPU platforms' Triton op table (interpreted): the q/k head norm fused
with the rotary, the one-kernel routing (top 3 of 5, unnormalised) at every step, then the
decode GEMVs that sum a token's experts or the grouped GEMM of prefill chunks; greedy tokens
equal HF's in float32. (Routing inside the decode GEMVs, paged.kernels.moe's
fused_moe_from_logits, is not in the op table: slower on an H200. The kernels' own tests,
against torch, cover renormalised and float32 routing: tests/kernels/test_moe.py,
test_moe_inline_routing.py.)"""

from __future__ import annotations

import pytest
import torch


@pytest.mark.slow  # 15 s: interpreted Triton through the engine, with the long checks
def test_triton_ops_match_hf(tmp_path, monkeypatch, engines_on, interpreter_only):
    from test_hf_parity import hf_greedy
    from test_long_prompt import TritonOnCpu
    from test_models_qwen3_moe import make_model
    from transformers import AutoModelForCausalLM

    from paged import LLM, SamplingParams
    from paged.kernels import moe, moe_routing

    path = make_model("qwen3_moe_unnorm", str(tmp_path / "qwen3_moe"))
    engines_on(TritonOnCpu())
    prompts = [list(range(5, 25)), [7, 8, 9]]  # decode steps of 2 tokens: per-pair GEMVs
    llm = LLM(path, dtype="float32", max_num_batched_tokens=16, num_kv_blocks=32,
              max_model_len=64)  # fmt: skip
    try:
        from paged.model import ops

        # the default (moe_route, then fused_moe: Triton's), not the inline-routed kernel
        assert ops.get("fused_moe_from_logits") is ops.fused_moe_from_logits
        assert ops.get("moe_route").__module__ == "paged.kernels.ops"
        # tokens of each layer call: GEMVs that route / that take moe_route's ids; moe_route
        inline, gemv, kernel = [], [], []
        gate_up, moe_route = moe._gate_up, moe_routing.moe_route

        def spy_gate_up(x, *args, route=None, **kw):
            (inline if route is not None else gemv).append(len(x))
            return gate_up(x, *args, route=route, **kw)

        def spy_route(logits, *args):
            kernel.append(len(logits))
            return moe_route(logits, *args)

        monkeypatch.setattr(moe, "_gate_up", spy_gate_up)
        monkeypatch.setattr(moe_routing, "moe_route", spy_route)
        params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    top_k = 3
    assert not inline  # every step routes with the kernel, decode too:
    assert 2 in kernel and 2 in gemv and max(gemv) * top_k <= moe.GEMV_MAX_PAIRS  # the GEMVs
    assert max(kernel) * top_k > moe.GEMV_MAX_PAIRS  # 16-token chunks: the grouped GEMM
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 5) for p in prompts]
