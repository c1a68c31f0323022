"""--kv-cache-dtype fp8 through the engine on the CPU backend (tiny random Llama, float32):
greedy output token-identical to HF with its K/V rounded through fp8 the same way, with
prefix caching, chunked prefill and preemption; the block count for the same memory; logprobs
close to the unquantized cache; scales from a checkpoint; refusals."""

from __future__ import annotations

import shutil

import pytest
import torch
from kv_fp8_hf import hf_greedy_fp8

from paged import LLM, SamplingParams
from paged.config import EngineConfig

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(2, 320, (37,), generator=g).tolist()
    out = [shared + torch.randint(2, 320, (n,), generator=g).tolist() for n in (1, 20)]
    out += [torch.randint(2, 320, (n,), generator=g).tolist() for n in (3, 17, 60)]
    return out + [shared + [5, 6, 7]] * 2  # duplicates share every full block


def tokens(llm: LLM, ps, params=GREEDY) -> list[list[int]]:
    outs = llm.generate(ps, params, use_tqdm=False)
    llm.engine.kv.check_invariants(list(llm.engine.requests.values()))
    assert llm.engine.kv.num_free_blocks == llm.engine.num_blocks, "blocks leaked"
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def llama(tiny_models) -> str:
    return tiny_models["llama"]


@pytest.fixture(scope="module")
def hf_fp8(llama) -> list[list[int]]:
    return hf_greedy_fp8(llama, prompts(), GREEDY.max_tokens, torch.float8_e4m3fn)


def test_unknown_value_refused(capsys):
    import argparse

    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8"):
        EngineConfig(kv_cache_dtype="int8")
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    assert EngineConfig.from_cli_args(parser.parse_args(["--kv-cache-dtype", "fp8_e5m2"])
                                      ).kv_cache_torch_dtype == torch.float8_e5m2  # fmt: skip
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "int8"])
    assert "invalid choice: 'int8'" in capsys.readouterr().err


@pytest.mark.parametrize("dtype,ratio", [("bfloat16", 2), ("float32", 4)])
def test_block_count_for_the_same_memory(llama, dtype, ratio):
    n = {}
    for kv in ("auto", "fp8"):
        llm = LLM(llama, dtype=dtype, kv_cache_memory="256KiB", kv_cache_dtype=kv)
        n[kv] = llm.engine.num_blocks
        assert llm.engine.runner.kv_caches[0].dtype == (
            torch.float8_e4m3fn if kv == "fp8" else getattr(torch, dtype)
        )
    assert n["fp8"] == ratio * n["auto"]


@pytest.mark.parametrize("cpu_native", [True, False])
def test_greedy_matches_hf_with_fp8_kv(llama, hf_fp8, cpu_native):
    """Batched, prefix cache on, prompts in 16-token chunks; decode through the C++ kernel
    (where built) and through torch ops."""
    llm = LLM(llama, dtype="float32", kv_cache_dtype="fp8", num_kv_blocks=128,
              max_num_batched_tokens=16, cpu_native=cpu_native)  # fmt: skip
    assert tokens(llm, prompts()) == hf_fp8
    again = llm.generate(prompts()[-1:], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 32  # prefix hit over fp8 blocks
    assert again.outputs[0].token_ids == hf_fp8[-1]


def test_preemption_with_fp8_kv(llama, hf_fp8):
    """A pool too small for the batch: requests are preempted and recomputed."""
    llm = LLM(llama, dtype="float32", kv_cache_dtype="fp8", num_kv_blocks=12, max_model_len=96)
    assert tokens(llm, prompts()) == hf_fp8
    assert llm.engine.scheduler.num_preemptions > 0


def test_e5m2_matches_hf(llama):
    ps = prompts()[2:5]
    llm = LLM(llama, dtype="float32", kv_cache_dtype="fp8_e5m2", num_kv_blocks=64)
    assert tokens(llm, ps) == hf_greedy_fp8(llama, ps, GREEDY.max_tokens, torch.float8_e5m2)


def test_logprobs_close_to_unquantized(llama):
    """The fp8 continuation scored by the unquantized cache: logprobs close."""
    ps = prompts()[2:5]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    fp8 = LLM(llama, dtype="float32", kv_cache_dtype="fp8", num_kv_blocks=64)
    full = LLM(llama, dtype="float32", num_kv_blocks=64)
    diffs = []
    for p, o in zip(ps, fp8.generate(ps, params, use_tqdm=False)):
        toks = o.outputs[0].token_ids
        score = SamplingParams(max_tokens=1, prompt_logprobs=0)
        ref = full.generate([p + toks], score, use_tqdm=False)[0].prompt_logprobs[len(p) :]
        diffs += [abs(d[t].logprob - r[t].logprob)
                  for t, d, r in zip(toks, o.outputs[0].logprobs, ref)]  # fmt: skip
    assert sum(diffs) / len(diffs) < 0.25 and max(diffs) < 2.0


SCALES = {0: (torch.tensor([0.02, 0.05]), torch.tensor([0.01, 0.03])),
          1: (torch.tensor([0.04, 0.04]), torch.tensor([0.02, 0.02]))}  # fmt: skip


def with_scales(src: str, dst, k1: torch.Tensor = torch.tensor(0.04)) -> str:
    """A copy of the checkpoint at `src` with KV cache scales: layer 0 one per KV head, layer 1
    per tensor (`k1` its k_scale)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, dirs_exist_ok=True)
    weights = load_file(dst / "model.safetensors")
    weights["model.layers.0.self_attn.k_scale"] = SCALES[0][0]
    weights["model.layers.0.self_attn.v_scale"] = SCALES[0][1]
    weights["model.layers.1.self_attn.k_scale"] = k1
    weights["model.layers.1.self_attn.v_scale"] = torch.tensor(0.02)
    save_file(weights, dst / "model.safetensors")
    return str(dst)


@pytest.fixture(scope="module")
def scaled(llama, tmp_path_factory) -> tuple[str, list[list[int]]]:
    """The checkpoint with scales and HF's greedy output with K/V rounded by them."""
    path = with_scales(llama, tmp_path_factory.mktemp("kv-scales"))
    return path, hf_greedy_fp8(path, prompts()[2:5], GREEDY.max_tokens, torch.float8_e4m3fn,
                               SCALES)  # fmt: skip


def test_checkpoint_scales(llama, hf_fp8, scaled, tmp_path):
    """k_scale / v_scale tensors of a checkpoint (per KV head, per tensor) are the cache's
    scales; with --kv-cache-dtype auto they are unused."""
    path, hf = scaled
    ps = prompts()[2:5]
    llm = LLM(path, dtype="float32", kv_cache_dtype="fp8", num_kv_blocks=64)
    runner = llm.engine.runner
    for i, cache in enumerate(runner.kv_caches):
        got = runner.backend.kv_scales(cache)
        assert all(torch.equal(g, w) for g, w in zip(got, SCALES[i]))
    assert tokens(llm, ps) == hf
    assert hf != hf_fp8[2:5]  # the scales change the rounding
    auto = LLM(path, dtype="float32", num_kv_blocks=64)
    plain = LLM(llama, dtype="float32", num_kv_blocks=64)
    assert tokens(auto, ps) == tokens(plain, ps)

    bad = with_scales(llama, tmp_path / "bad", k1=torch.ones(3))
    with pytest.raises(ValueError, match="layer 1 k_scale: 3 values"):
        LLM(bad, dtype="float32", kv_cache_dtype="fp8", num_kv_blocks=64)


def test_tensor_parallel_shards_per_head_scales(scaled):
    """Two ranks (gloo, one KV head each): each rank's cache takes its own head's scale."""
    path, hf = scaled
    llm = LLM(path, dtype="float32", kv_cache_dtype="fp8", num_kv_blocks=64,
              tensor_parallel_size=2)  # fmt: skip
    try:
        assert tokens(llm, prompts()[2:5]) == hf
    finally:
        llm.engine.shutdown()


def test_platform_without_fp8_refused(llama, engines_on):
    from paged_cpu.attention import CpuAttentionBackend
    from paged_cpu.platform import CpuPlatform

    class Plain(CpuAttentionBackend):
        name = "plain"
        quantized_cache_dtypes = frozenset()

    class NoFp8(CpuPlatform):
        name = "no-fp8"

        def attention_backend(self):
            return Plain

    engines_on(NoFp8())
    why = "--kv-cache-dtype fp8 is not supported on platform no-fp8: attention backend .* cannot"
    with pytest.raises(ValueError, match=why + " store the KV cache as float8_e4m3fn"):
        LLM(llama, dtype="float32", kv_cache_dtype="fp8", num_kv_blocks=64)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_native_fp8_matches_torch_path(fp8, dtype):
    """A mixed step (decodes, a chunk over cached context, a fresh prompt) through the CPU
    backend with the C++ kernel's paged_decode_fp8 and with torch ops: the same fp8 bytes
    (the torch quantizer's) and outputs."""
    from test_cpu_kernels import native_or_skip

    from paged.model.attention import AttentionMetadata
    from paged_cpu.attention import CpuAttentionBackend

    native_or_skip()
    torch.manual_seed(0)
    hq, hk, d, bs, nblocks = 8, 2, 64, 16, 32  # head_dim 64, group 4: the register kernel
    args = (hq, hk, d, d**-0.5, bs, dtype, torch.device("cpu"))
    with_native, plain = CpuAttentionBackend(*args), CpuAttentionBackend(*args, native=False)
    cache = (torch.randn(with_native.kv_cache_shape(nblocks)) * 4).to(fp8)
    ks, vs = torch.tensor([0.5, 2.0]), torch.tensor([0.25, 1.5])
    q_lens, seq_lens = [1, 1, 7, 5], [20, 33, 23, 5]
    tables = torch.tensor([[0, 1, 0], [2, 3, 4], [5, 6, 0], [7, 0, 0]], dtype=torch.int32)
    slots = []
    for ql, sl, row in zip(q_lens, seq_lens, tables.tolist()):
        slots += [row[p // bs] * bs + p % bs for p in range(sl - ql, sl)]
    t = sum(q_lens)
    meta = AttentionMetadata(
        num_reqs=4, num_decodes=2, num_tokens=t,
        query_start_loc=torch.tensor([0, 1, 2, 9, 14], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables,
        slot_mapping=torch.tensor(slots), max_query_len=7, max_seq_len=33,
        query_lens_cpu=q_lens, seq_lens_cpu=seq_lens,
    )  # fmt: skip
    q, k, v = (torch.randn(t, n, d).to(dtype) for n in (hq, hk, hk))
    outs, caches = [], []
    for backend in (with_native, plain):
        backend.use_cache_dtype(fp8)
        c = cache.clone()
        backend.bind_kv_scales(c, ks, vs)
        outs.append(backend.forward(q, k, v, c, backend.plan(meta)))
        caches.append(c.view(torch.uint8))
    assert hasattr(with_native.native, "paged_decode_fp8") and plain.native is None
    assert torch.equal(caches[0], caches[1])
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the torch path rounds probs
    top = outs[1].float().abs().max().item()
    torch.testing.assert_close(outs[0].float(), outs[1].float(), atol=tol * top, rtol=tol)
