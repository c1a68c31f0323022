"""Qwen3-MoE through the GPU platforms' Triton op table (interpreted): the q/k head norm fused
with the rotary, the one-kernel routing (top 3 of 5, unnormalised) and the decode GEMVs that
sum a token's experts; greedy tokens equal HF's in float32. (The kernels' own tests, against
torch, cover renormalised and float32 routing: tests/kernels/test_moe.py.)"""

from __future__ import annotations

import torch


def test_triton_ops_match_hf(tmp_path, monkeypatch, interpreter_only):
    from test_hf_parity import hf_greedy
    from test_long_prompt import TritonOnCpu
    from test_models_qwen3_moe import make_model
    from transformers import AutoModelForCausalLM

    from paged import LLM, SamplingParams
    from paged.kernels.moe_routing import moe_route as route

    path = make_model("qwen3_moe_unnorm", str(tmp_path / "qwen3_moe"))
    for where in ("paged.engine.core", "paged.worker.worker"):
        monkeypatch.setattr(f"{where}.select_platform", lambda name=None: TritonOnCpu())
    prompts = [list(range(5, 25)), [7, 8, 9]]  # decode steps of 2 tokens: per-pair GEMVs
    llm = LLM(path, dtype="float32", max_num_batched_tokens=16, num_kv_blocks=32,
              max_model_len=64)  # fmt: skip
    try:
        from paged.kernels import moe_routing
        from paged.model import ops

        assert ops.get("moe_route").__module__ == "paged.kernels.ops"  # the Triton table
        calls = []
        monkeypatch.setattr(moe_routing, "moe_route", lambda *a: calls.append(1) or route(*a))
        params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    assert calls  # the routing kernel ran
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 5) for p in prompts]
