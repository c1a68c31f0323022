"""``--baseline hf``: HF transformers on paged's own weights, every mode, tiny sizes on CPU."""

from __future__ import annotations

import json

import pytest
import tiny_hf
import torch

TINY = ["--load-format", "dummy", "--dtype", "float32", "--kv-cache-memory", "8MiB"]


def _modes() -> set[str]:
    from transformers import LlamaForCausalLM

    return {"eager", "static"} | (
        {"batch"} if hasattr(LlamaForCausalLM, "generate_batch") else set()
    )


def test_throughput_baseline_hf(cli, tiny_llama, tmp_path):
    out_json = tmp_path / "tp.json"
    rc, out, err = cli(
        "bench", "throughput", "--model", tiny_llama, *TINY, "--input-len", "8",
        "--output-len", "4", "--num-prompts", "4", "--baseline", "hf", "--hf-batch-size", "2",
        "--save-json", out_json, "--disable-tqdm",
    )  # fmt: skip
    assert rc == 0, err + out
    assert "paged vs HF transformers (same weights)" in out and "hf generate static" in out
    data = json.loads(out_json.read_text())
    assert set(data["hf"]) == _modes(), data["hf_skipped"]
    for mode, r in data["hf"].items():
        assert r["num_prompts"] == 4 and r["total_output_tokens"] == 16, mode  # never stops early
        assert r["output_tokens_per_s"] > 0 and r["paged_speedup"] > 0
    assert data["hf"]["eager"]["batch_size"] == 2
    assert data["total_output_tokens"] == 16  # paged's own figures are still there


def test_latency_baseline_hf(cli, tiny_llama, tmp_path):
    out_json = tmp_path / "lat.json"
    rc, out, err = cli(
        "bench", "latency", "--model", tiny_llama, *TINY, "--input-len", "8", "--output-len",
        "4", "--batch-size", "2", "--num-iters", "1", "--baseline", "hf",
        "--hf-modes", "eager,static,batch", "--save-json", out_json, "--disable-tqdm",
    )  # fmt: skip
    assert rc == 0, err + out
    assert "ms/token" in out and "TTFT" in out
    data = json.loads(out_json.read_text())
    assert set(data["hf"]) == _modes(), data["hf_skipped"]
    for r in data["hf"].values():
        assert r["batch_size"] == 1 and 0 < r["ttft_ms"] <= r["mean_ttft_ms"]
        assert 0 < r["e2el_ms"] <= r["mean_e2el_ms"] and "tpot_ms" in r
    assert data["hf"]["static"]["compiled"] is False  # transformers compiles on GPUs only


def test_unknown_hf_mode(cli, tiny_llama):
    rc, _, err = cli(
        "bench", "latency", "--model", tiny_llama, *TINY, "--input-len", "4", "--output-len",
        "2", "--batch-size", "1", "--num-iters", "1", "--baseline", "hf", "--hf-modes", "fast",
    )  # fmt: skip
    assert rc == 1 and "--hf-modes: unknown ['fast']" in err


@pytest.fixture(scope="module")
def tied_llama(tmp_path_factory) -> str:
    """A tiny Llama with tied embeddings (as SmolLM2 and Llama-3.2-1B have)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = str(tmp_path_factory.mktemp("tied") / "tied-llama")
    cfg = LlamaConfig(**tiny_hf.TINY, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.mark.parametrize(
    "model,load_format", [("tiny", "dummy"), ("tiny", "auto"), ("tied", "dummy")]
)
def test_hf_copy_has_paged_weights(request, model, load_format):
    """Same greedy tokens from HF as from paged: HF really runs paged's (dummy) weights."""
    from transformers import GenerationConfig

    from paged import LLM, SamplingParams
    from paged.cli.bench_hf import hf_model

    path = request.getfixturevalue("tiny_llama" if model == "tiny" else "tied_llama")
    llm = LLM(path, load_format=load_format, dtype="float32", kv_cache_memory="8MiB")
    prompts = [[5, 17, 42, 99, 3, 250, 7], [11, 12, 13, 14, 15, 16, 200]]
    n = 12
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    hf = hf_model(llm)
    if load_format == "dummy":  # views of paged's tensors, not copies
        qkv = llm.engine.runner.model.layers[0].self_attn.qkv_proj.weight
        assert hf.model.layers[0].self_attn.q_proj.weight.data_ptr() == qkv.data_ptr()
    if model == "tied":
        assert hf.lm_head.weight is hf.model.embed_tokens.weight
    ids = torch.tensor(prompts)
    out = hf.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        generation_config=GenerationConfig(do_sample=False, max_new_tokens=n, pad_token_id=0),
    )
    assert out[:, ids.shape[1] :].tolist() == [list(t) for t in ours]
