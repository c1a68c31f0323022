"""Offline multi-LoRA: one batch mixing two PEFT adapters and the base model is greedy
token-identical to HF with each adapter merged (float32); slots, eviction, prefix caching."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_hf import spread_weights

from paged import LLM, SamplingParams
from paged.lora import LoRARequest

N = 12
PARAMS = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)


def prompts(count: int, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 320, (n,), generator=g).tolist() for n in (5, 19, 33, 8, 26, 12)][
        :count
    ]


@pytest.fixture(scope="module")
def llm(lora_model):
    # two slots; chunks of 32 tokens: prompts are split, decodes and prefills mix
    return LLM(lora_model, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8,
               kv_cache_memory="16MiB", max_num_batched_tokens=32)  # fmt: skip


def test_mixed_batch_matches_hf_merged(llm, adapters, hf_models, hf_greedy):
    req = {n: LoRARequest(n, i, p) for i, (n, p) in enumerate(adapters.items(), start=1)}
    names = ["alpha", "beta", None, "alpha", None, "beta"]
    ps = prompts(len(names))
    outs = llm.generate(ps, PARAMS, use_tqdm=False,
                        lora_request=[req[n] if n else None for n in names])  # fmt: skip
    got = [o.outputs[0].token_ids for o in outs]
    for p, name, toks in zip(ps, names, got):
        assert toks == hf_greedy(hf_models[name], p, N), name
    # the adapters change the output (the comparison above is not the base model's thrice)
    base = [hf_greedy(hf_models[None], p, N) for p in ps]
    assert all(g != b for g, b, n in zip(got, base, names) if n)
    assert llm.engine.runner.lora.loads == 2
    llm.engine.kv.check_invariants()
    assert llm.engine.kv.num_free_blocks == llm.engine.num_blocks


def test_prefix_cache_is_per_adapter(llm, adapters):
    a = LoRARequest("alpha", 1, adapters["alpha"])
    p = prompts(3, seed=11)[2]  # 33 tokens: two full blocks, not run before
    first = llm.generate([p], PARAMS, use_tqdm=False, lora_request=a)[0]
    again = llm.generate([p], PARAMS, use_tqdm=False, lora_request=a)[0]
    base = llm.generate([p], PARAMS, use_tqdm=False)[0]
    assert again.num_cached_tokens == 32
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert base.num_cached_tokens == 0  # the adapter's blocks are not the base model's


def test_bad_adapters_refused_engine_lives(llm, adapters, tmp_path):
    import json

    with pytest.raises(ValueError, match="not a directory"):
        llm.generate([[5, 6]], PARAMS, use_tqdm=False,
                     lora_request=LoRARequest("x", 9, str(tmp_path / "missing")))  # fmt: skip
    dora = tmp_path / "dora"
    dora.mkdir()
    cfg = json.loads((Path(adapters["alpha"]) / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(ValueError, match="DoRA"):
        llm.generate([[5, 6]], PARAMS, use_tqdm=False, lora_request=LoRARequest("d", 10, str(dora)))
    with pytest.raises(ValueError, match="already used"):
        llm.generate([[5, 6]], PARAMS, use_tqdm=False,
                     lora_request=LoRARequest("b", 1, adapters["beta"]))  # fmt: skip
    assert len(llm.generate([[5, 6]], PARAMS, use_tqdm=False)[0].outputs[0].token_ids) == N
    llm.engine.kv.check_invariants()


def test_more_adapters_than_slots(lora_model, adapters, hf_models, hf_greedy):
    """One slot and one host copy: the two adapters take turns (never together in a step),
    evicted and reloaded, and the outputs still match."""
    llm = LLM(lora_model, dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=8,
              kv_cache_memory="16MiB", enable_prefix_caching=False)  # fmt: skip
    req = {n: LoRARequest(n, i, p) for i, (n, p) in enumerate(adapters.items(), start=1)}
    names = ["alpha", "beta", "alpha", None, "beta"]
    ps = prompts(len(names), seed=7)
    outs = llm.generate(ps, PARAMS, use_tqdm=False,
                        lora_request=[req[n] if n else None for n in names])  # fmt: skip
    for p, name, o in zip(ps, names, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf_models[name], p, N), name
    assert llm.engine.runner.lora.loads >= 2
    llm.engine.kv.check_invariants()


def test_adapter_gone_from_disk_fails_its_step_not_the_engine(lora_model, adapters, tmp_path):
    """An adapter whose files vanish after its first use: reloading it (evicted from the one
    slot and the one host copy) fails that step's requests; the engine serves on."""
    import shutil

    llm = LLM(lora_model, dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=8,
              kv_cache_memory="16MiB")  # fmt: skip
    copy = shutil.copytree(adapters["beta"], tmp_path / "beta")
    gone, alpha = LoRARequest("gone", 3, str(copy)), LoRARequest("alpha", 1, adapters["alpha"])
    llm.generate([[5, 6, 7]], PARAMS, use_tqdm=False, lora_request=gone)
    shutil.rmtree(copy)
    llm.generate([[5, 6, 7]], PARAMS, use_tqdm=False, lora_request=alpha)  # evicts "gone"
    for _ in range(2):  # the slot is not lost: alpha still runs after each failure
        with pytest.raises(RuntimeError, match="adapter_model"):
            llm.generate([[5, 6, 7]], PARAMS, use_tqdm=False, lora_request=gone)
        llm.generate([[5, 6, 7]], PARAMS, use_tqdm=False, lora_request=alpha)
    assert len(llm.generate([[5, 6]], PARAMS, use_tqdm=False)[0].outputs[0].token_ids) == N
    llm.engine.kv.check_invariants()
    assert llm.engine.kv.num_free_blocks == llm.engine.num_blocks


def test_lora_request_needs_enable_lora(lora_model, adapters):
    from paged.config import EngineConfig

    with pytest.raises(ValueError, match="enable-lora"):
        EngineConfig(model=lora_model, lora_modules=[f"a={adapters['alpha']}"])
    with pytest.raises(ValueError, match="pipeline_micro_batches"):
        EngineConfig(model=lora_model, enable_lora=True, pipeline_parallel_size=2,
                     pipeline_micro_batches=2)  # fmt: skip


def test_fused_projections_phi3(tmp_path, adapter_maker, hf_greedy):
    """Phi-3 holds q/k/v and gate/up fused in HF too: adapters target qkv_proj and
    gate_up_proj, one A for the stacked output and B split over our slices."""
    import transformers as tf
    from peft import PeftModel

    cfg = tf.Phi3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, vocab_size=320,
                        max_position_embeddings=512, eos_token_id=1, bos_token_id=0,
                        pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    model = tf.Phi3ForCausalLM(cfg).eval()
    spread_weights(model)
    path = str(tmp_path / "phi3")
    model.save_pretrained(path)
    targets = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    ad = adapter_maker(path, str(tmp_path / "ad"), 5, r=8, lora_alpha=16, target_modules=targets)
    base = tf.Phi3ForCausalLM.from_pretrained(path, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, ad).merge_and_unload().eval()
    llm = LLM(path, dtype="float32", enable_lora=True, max_lora_rank=8, kv_cache_memory="16MiB")
    p = prompts(2)[1]
    out = llm.generate([p], PARAMS, use_tqdm=False, lora_request=LoRARequest("a", 1, ad))
    assert out[0].outputs[0].token_ids == hf_greedy(merged, p, N)


def test_warmup_runs_the_first_lora_module_then_forgets_it(lora_model, adapters):
    """With --lora-modules the warm-up's steps mix adapter and base rows (the LoRA kernels
    compile before any client's request); afterwards no slot, spec or host copy is left and
    a client's adapter runs as on an engine without warm-up."""
    from paged.engine.warmup import WARMUP_LORA_ID, warm_up

    kw = dict(dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8,
              kv_cache_memory="16MiB", max_num_batched_tokens=32,
              lora_modules=[f"beta={adapters['beta']}"])  # fmt: skip
    llm = LLM(lora_model, kernel_warmup=False, **kw)
    engine, steps = llm.engine, []
    launch = engine.executor.launch
    engine.executor.launch = lambda batch, prev: steps.append(
        [getattr(r, "lora_request", None) for r in batch.reqs]) or launch(batch, prev)
    warm_up(engine)
    del engine.executor.launch
    assert any(None in s and any(s) for s in steps)  # adapter and base rows in one step
    assert {r.lora_int_id for s in steps for r in s if r} == {WARMUP_LORA_ID}
    lora = engine.runner.lora
    assert not lora.slot_of and not lora.specs and not lora.host and lora.loads == 0
    assert engine.kv.num_free_blocks == engine.num_blocks and not engine.kv.cached
    a = LoRARequest("alpha", 1, adapters["alpha"])
    fresh = LLM(lora_model, kernel_warmup=False, **kw)
    ps = prompts(3)
    want = [o.outputs[0].token_ids for o in fresh.generate(ps, PARAMS, use_tqdm=False,
                                                            lora_request=[a, None, a])]  # fmt: skip
    got = [o.outputs[0].token_ids for o in llm.generate(ps, PARAMS, use_tqdm=False,
                                                        lora_request=[a, None, a])]  # fmt: skip
    assert got == want
