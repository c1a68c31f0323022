"""LLM.embed / EngineCore embedding requests against HF's hidden states pooled the same way:
chunked prefill (prompts longer than a chunk), prefix caching on, mixed with generation."""

from __future__ import annotations

import pytest
import torch
from emb_helpers import hf_pooled, prompts

from paged import LLM
from paged.engine.pooling import embedding_params
from paged.pooling_params import PoolingParams
from paged.sampling.params import SamplingParams

ENGINE = dict(dtype="float32", block_size=16, max_num_batched_tokens=32, num_kv_blocks=64,
              enable_prefix_caching=True)  # fmt: skip
LENGTHS = [5, 16, 37, 70]  # 37 and 70 take several 32-token chunks


def close(got, want) -> None:
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(torch.tensor(g), w, atol=2e-5, rtol=1e-4)


def check_kv(llm: LLM) -> None:
    kv = llm.engine.kv
    kv.check_invariants()
    assert kv.num_free_blocks == llm.engine.num_blocks  # nothing leaked


@pytest.fixture(scope="module")
def qwen3(qwen3_embedding):
    return LLM(qwen3_embedding, **ENGINE)


def test_qwen3_embedding_layout_last_token(qwen3, qwen3_embedding):
    """Qwen3Model checkpoint + sentence-transformers files: pooling runner, LAST, normalised."""
    assert qwen3.engine.config.runner == "pooling"
    assert (qwen3.engine.pooler.pooling_type, qwen3.engine.pooler.normalize) == ("LAST", True)
    ps = prompts(LENGTHS)
    want = hf_pooled(qwen3_embedding, ps, "LAST", normalize=True)
    first = qwen3.embed(ps, use_tqdm=False)
    close([o.outputs.embedding for o in first], want)
    assert [o.prompt_token_ids for o in first] == ps
    again = qwen3.embed(ps, use_tqdm=False)  # full blocks now come from the prefix cache
    assert again[3].num_cached_tokens == 64
    close([o.outputs.embedding for o in again], want)
    check_kv(qwen3)


def test_mean_and_cls_across_chunks(qwen3, qwen3_embedding):
    """Per-request pooling types (the engine fills the model's default otherwise): MEAN sums
    across chunks, CLS keeps the first token's state; neither takes prefix-cache hits."""
    ps = prompts(LENGTHS, seed=1)
    for kind in ("MEAN", "CLS"):
        p = PoolingParams(pooling_type=kind, normalize=kind == "MEAN")
        for _ in range(2):  # the second run has every full block cached
            out = qwen3.embed(ps, pooling_params=p, use_tqdm=False)
            close(
                [o.outputs.embedding for o in out],
                hf_pooled(qwen3_embedding, ps, kind, kind == "MEAN"),
            )
            assert all(o.num_cached_tokens == 0 for o in out)
    check_kv(qwen3)


def test_dimensions_truncation_and_encode(qwen3, qwen3_embedding):
    ps = prompts([9, 40], seed=2)
    hidden = hf_pooled(qwen3_embedding, ps, "LAST", normalize=False)
    out = qwen3.embed(ps, pooling_params=PoolingParams(dimensions=16), use_tqdm=False)
    close([o.outputs.embedding for o in out],
          [torch.nn.functional.normalize(h[:16], dim=-1) for h in hidden])  # fmt: skip
    enc = qwen3.encode(ps, use_tqdm=False)
    assert enc[0].outputs.data.dtype == torch.float32
    close(
        [o.outputs.data.tolist() for o in enc],
        [torch.nn.functional.normalize(h, dim=-1) for h in hidden],
    )
    with pytest.raises(ValueError, match="dimensions: 65 exceeds"):
        qwen3.embed(ps, pooling_params=PoolingParams(dimensions=65), use_tqdm=False)
    check_kv(qwen3)


def test_truncate_and_refusals(qwen3, qwen3_embedding):
    long = prompts([300], seed=3)[0]  # longer than max_model_len (256)
    with pytest.raises(ValueError, match="input: this model's maximum context length is 256"):
        qwen3.embed([long], use_tqdm=False)
    out = qwen3.embed([long], truncate_prompt_tokens=100, use_tqdm=False)
    assert out[0].prompt_token_ids == long[-100:]
    close([out[0].outputs.embedding], hf_pooled(qwen3_embedding, [long[-100:]], "LAST", True))
    full = qwen3.embed([long[-256:]], use_tqdm=False)  # a prompt may fill the whole context
    close([full[0].outputs.embedding], hf_pooled(qwen3_embedding, [long[-256:]], "LAST", True))
    with pytest.raises(ValueError, match="model: this model runs for pooling"):
        qwen3.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
    check_kv(qwen3)


@pytest.mark.parametrize("overlap", [False, True])
def test_llama_with_head_mixes_generation_and_embeddings(llama_lm, overlap):
    """A model with an LM head runs for generation (auto) and takes embedding requests in the
    same steps; greedy tokens are unchanged by the embeddings batched with them. With
    overlapped steps an embedding request's last chunk is in flight while the next step is
    scheduled."""
    llm = LLM(llama_lm, async_scheduling=overlap, **ENGINE)
    assert llm.engine.config.runner == "generate"
    ps = prompts([12, 45, 70], seed=4)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(ps, greedy, use_tqdm=False)]
    eng = llm.engine
    for i, p in enumerate(ps):
        eng.add_request(f"g{i}", p, greedy)
        eng.add_request(f"e{i}", p, embedding_params(PoolingParams(pooling_type="MEAN")))
    tokens, vecs = {}, {}
    while eng.has_unfinished():
        for eo in eng.step():
            assert eo.error is None
            tokens.setdefault(eo.request_id, []).extend(eo.new_token_ids)
            if eo.embedding is not None:
                vecs[eo.request_id] = eo.embedding
    assert [tokens[f"g{i}"] for i in range(3)] == alone
    assert all(tokens[f"e{i}"] == [] for i in range(3))
    close([vecs[f"e{i}"] for i in range(3)], hf_pooled(llama_lm, ps, "MEAN", normalize=True))
    out = llm.embed(ps, use_tqdm=False)  # the default for a generative model: LAST, normalised
    close([o.outputs.embedding for o in out], hf_pooled(llama_lm, ps, "LAST", normalize=True))
    with pytest.raises(ValueError, match="dimensions: this model does not support Matryoshka"):
        llm.embed(ps, pooling_params=PoolingParams(dimensions=8), use_tqdm=False)
    check_kv(llm)


def test_pooler_config_flag(llama_lm):
    """--runner pooling --pooler-config: no LM head is built; CLS without normalisation."""
    pooler = '{"pooling_type": "CLS", "normalize": false}'
    llm = LLM(llama_lm, runner="pooling", pooler_config=pooler, **ENGINE)
    assert llm.engine.runner.model.lm_head is None
    ps = prompts([3, 50], seed=5)
    out = llm.embed(ps, use_tqdm=False)
    close([o.outputs.embedding for o in out], hf_pooled(llama_lm, ps, "CLS", normalize=False))
    check_kv(llm)


def test_mean_pooling_survives_preemption(llama_lm):
    """A pool too small for both: a decoding request that needs a block preempts the
    embedding request in the middle of its prompt, which is recomputed from position 0
    (MEAN starts its sum over); its vector still equals HF's, the tokens are unchanged."""
    llm = LLM(llama_lm, **{**ENGINE, "num_kv_blocks": 8, "max_model_len": 128})
    gen, emb = prompts([15, 120], seed=7)
    greedy = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    alone = llm.generate([gen], greedy, use_tqdm=False)[0].outputs[0].token_ids
    eng, tokens, vec = llm.engine, [], None
    eng.add_request("g", gen, greedy)
    eng.add_request("e", emb, embedding_params(PoolingParams(pooling_type="MEAN")))
    while eng.has_unfinished():
        for eo in eng.step():
            tokens += eo.new_token_ids if eo.request_id == "g" else []
            vec = eo.embedding if eo.request_id == "e" else vec
    assert eng.scheduler.num_preemptions > 0
    assert tokens == alone
    close([vec], hf_pooled(llama_lm, [emb], "MEAN", True))
    check_kv(llm)


def test_causal_lm_architecture_without_head(qwen3_embedding, tmp_path):
    """The same checkpoint labelled Qwen3ForCausalLM (as Qwen3-Embedding's config.json is):
    no lm_head tensor, so --runner auto pools, and the weights load without one."""
    import json
    import shutil

    path = shutil.copytree(qwen3_embedding, tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(cfg | {"architectures": ["Qwen3ForCausalLM"]}))
    llm = LLM(str(path), **ENGINE)
    assert llm.engine.config.runner == "pooling"
    ps = prompts([20], seed=8)
    close([llm.embed(ps, use_tqdm=False)[0].outputs.embedding],
          hf_pooled(qwen3_embedding, ps, "LAST", True))  # fmt: skip


def test_lora_adapter_embeddings(llama_lm, tmp_path):
    """A PEFT adapter selected per request: vectors equal HF's with the adapter merged, in one
    batch with requests on the base model."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    from paged.lora.request import LoRARequest

    base = AutoModelForCausalLM.from_pretrained(llama_lm, dtype=torch.float32)
    targets = ["q_proj", "v_proj", "down_proj"]
    config = LoraConfig(r=8, lora_alpha=16, init_lora_weights=False, target_modules=targets)
    model = get_peft_model(base, config)
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)
    model.save_pretrained(tmp_path / "adapter")
    base = AutoModelForCausalLM.from_pretrained(llama_lm, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).merge_and_unload()
    merged.model.save_pretrained(tmp_path / "merged")  # the bare decoder, for AutoModel
    llm = LLM(llama_lm, enable_lora=True, max_loras=1, max_lora_rank=8, **ENGINE)
    ps = prompts([10, 40], seed=10)
    lora = LoRARequest("a", 1, str(tmp_path / "adapter"))
    out = llm.embed(ps + ps, lora_request=[lora, lora, None, None], use_tqdm=False)
    want = hf_pooled(str(tmp_path / "merged"), ps, "LAST", True)
    close([o.outputs.embedding for o in out], want + hf_pooled(llama_lm, ps, "LAST", True))
    assert not torch.allclose(
        torch.tensor(out[0].outputs.embedding), torch.tensor(out[2].outputs.embedding), atol=1e-3
    )
    check_kv(llm)
