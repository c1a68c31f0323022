"""LoRA under tensor and pipeline parallelism (gloo, two worker processes on CPU). Each rank
holds its shard of every adapter (column-parallel projections their rows of B, row-parallel
ones their columns of A; a pipeline stage its own layers) and loads the driver's adapters into
the same slots. A batch mixing two adapters and the base model is greedy-identical to HF with
each adapter merged; one slot forces evictions; an adapter id unloaded and reused for another
adapter is reloaded on every rank; an adapter gone from disk fails its step on every rank, and
the engine serves on."""

from __future__ import annotations

import shutil

import pytest
import torch

from paged import LLM, SamplingParams
from paged.lora import LoRARequest

N = 10
PARAMS = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)


def test_tp2_matches_hf_merged(lora_model, adapters, hf_models, hf_greedy, tmp_path):
    g = torch.Generator().manual_seed(11)
    ps = [torch.randint(2, 320, (n,), generator=g).tolist() for n in (6, 21, 9, 30, 14)]
    llm = LLM(lora_model, dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=8,
              kv_cache_memory="16MiB", max_num_batched_tokens=32,
              tensor_parallel_size=2)  # fmt: skip
    try:
        alpha, beta = (
            LoRARequest("alpha", 1, adapters["alpha"]),
            LoRARequest("beta", 2, adapters["beta"]),
        )
        names = ["alpha", None, "beta", "alpha", "beta"]
        reqs = {"alpha": alpha, "beta": beta, None: None}
        outs = llm.generate(ps, PARAMS, use_tqdm=False, lora_request=[reqs[n] for n in names])
        for p, name, o in zip(ps, names, outs):
            assert o.outputs[0].token_ids == hf_greedy(hf_models[name], p, N), name
        assert llm.engine.runner.lora.loads >= 3  # one slot: adapters took turns in it

        llm.engine.remove_lora(1)  # id 1 now names beta's weights, on every rank
        again = LoRARequest("beta-as-1", 1, adapters["beta"])
        out = llm.generate([ps[0]], PARAMS, use_tqdm=False, lora_request=again)[0]
        assert out.outputs[0].token_ids == hf_greedy(hf_models["beta"], ps[0], N)

        copy = shutil.copytree(adapters["alpha"], tmp_path / "alpha")
        gone = LoRARequest("gone", 3, str(copy))
        llm.generate([ps[1]], PARAMS, use_tqdm=False, lora_request=gone)
        shutil.rmtree(copy)
        llm.generate([ps[1]], PARAMS, use_tqdm=False, lora_request=beta)  # evicts "gone"
        with pytest.raises(RuntimeError, match="adapter_model"):  # every rank fails to load
            llm.generate([ps[1]], PARAMS, use_tqdm=False, lora_request=gone)
        alpha = LoRARequest("alpha-as-4", 4, adapters["alpha"])  # id 1 is beta's now
        out = llm.generate([ps[1]], PARAMS, use_tqdm=False, lora_request=alpha)[0]
        assert out.outputs[0].token_ids == hf_greedy(hf_models["alpha"], ps[1], N)
        llm.engine.kv.check_invariants()
        assert llm.engine.kv.num_free_blocks == llm.engine.num_blocks
    finally:
        llm.engine.shutdown()


def test_pp2_matches_hf_merged(lora_model, adapters, hf_models, hf_greedy):
    g = torch.Generator().manual_seed(12)
    ps = [torch.randint(2, 320, (n,), generator=g).tolist() for n in (7, 40, 12)]
    llm = LLM(lora_model, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8,
              kv_cache_memory="16MiB", max_num_batched_tokens=32,
              pipeline_parallel_size=2)  # fmt: skip
    try:
        reqs = [LoRARequest("alpha", 1, adapters["alpha"]), None,
                LoRARequest("beta", 2, adapters["beta"])]  # fmt: skip
        outs = llm.generate(ps, PARAMS, use_tqdm=False, lora_request=reqs)
        for p, name, o in zip(ps, ["alpha", None, "beta"], outs):
            assert o.outputs[0].token_ids == hf_greedy(hf_models[name], p, N), name
    finally:
        llm.engine.shutdown()
