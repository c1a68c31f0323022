"""The fp8 KV cache in the Triton kernels (interpreter, tiny shapes): the cache write quantizes
bit-exactly as the torch reference (paged.model.kv_quant.quantize, per-head scales), and the
prefill / chunked / long-prompt / split-K decode kernels read it as the float64 reference
over the dequantized cache."""

import pytest
import torch
from test_attention import CASES, TOL, i32, make_cache, reference, rel_err, strided_q

from paged.kernels import paged_attention_decode, paged_attention_varlen, reshape_and_cache
from paged.model.kv_quant import dequantize, quantize

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def fp8_cache(seq_lens, kv_heads, head_dim, block_size, fp8, gen, device):
    """A random fp8 cache (values spread over the fp8 range by per-head scales), its scales,
    the float32 values it stands for, and a block table."""
    kv, table = make_cache(seq_lens, kv_heads, head_dim, block_size, torch.float32, gen, device)
    scales = (torch.rand(2, kv_heads, generator=gen) + 0.05).to(device)
    kv = kv * 3 * scales[:, None, None, :, None]  # |x / scale| reaches ~15
    q8 = torch.stack([quantize(kv[i], scales[i], fp8) for i in (0, 1)])
    deq = torch.stack([dequantize(q8[i], scales[i], torch.float32) for i in (0, 1)])
    return q8, scales, deq, table


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 24])
def test_cache_write_matches_torch_quantize(fp8, dtype, head_dim, device):
    gen = torch.Generator().manual_seed(head_dim)
    tokens, heads = 40, 3
    # magnitudes from 1e-4 to 1e3: fp8 subnormals, rounding carries, saturation
    mag = torch.logspace(-4, 3, tokens)[:, None, None]
    k = (torch.randn(tokens, heads, head_dim, generator=gen) * mag).to(device, dtype)
    v = torch.randn(tokens, heads, head_dim, generator=gen).to(device, dtype)
    ks = torch.tensor([0.5, 1.0, 2.0], device=device)
    vs = torch.tensor([1.0, 0.1, 3.0], device=device)
    cache = torch.zeros(2, 5, 16, heads, head_dim, dtype=fp8, device=device)
    slots = torch.randperm(80, generator=gen)[:tokens].to(device)
    slots[7] = -1  # padding: not written
    reshape_and_cache(k, v, cache[0], cache[1], slots, ks, vs)
    keep = slots >= 0
    for i, (x, s) in enumerate(((k, ks), (v, vs))):
        got = cache[i].view(-1, heads, head_dim)[slots[keep]]
        want = quantize(x[keep], s, fp8)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert cache.view(torch.uint8).count_nonzero() <= 2 * (tokens - 1) * heads * head_dim


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_varlen_reads_fp8(fp8, dtype, case, device):
    gen = torch.Generator().manual_seed(hash((case, str(dtype), str(fp8))) % 2**31)
    heads, kv_heads, head_dim, block_size = 8, 2, 64, 16
    seq_lens, query_lens = CASES[case]
    query_lens = query_lens or seq_lens
    kv, scales, deq, table = fp8_cache(seq_lens, kv_heads, head_dim, block_size, fp8, gen,
                                       device)  # fmt: skip
    q = strided_q(sum(query_lens), heads, kv_heads, head_dim, dtype, gen, device)
    out = torch.full(q.shape, float("nan"), dtype=dtype, device=device)
    qsl = i32([0, *torch.tensor(query_lens).cumsum(0).tolist()], device)
    scale = head_dim**-0.5
    paged_attention_varlen(
        q, kv[0], kv[1], out, qsl, i32(seq_lens, device), table, scale,
        max(query_lens), max(seq_lens), k_scale=scales[0], v_scale=scales[1],
    )  # fmt: skip
    ref = reference(q, deq[0], deq[1], query_lens, seq_lens, table, scale)
    assert not out.isnan().any()
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_reads_fp8(fp8, dtype, num_splits, device):
    gen = torch.Generator().manual_seed(num_splits + 10 * FP8.index(fp8))
    heads, kv_heads, head_dim, block_size = 8, 2, 64, 16
    seq_lens = [1, 16, 33, 150]
    kv, scales, deq, table = fp8_cache(seq_lens, kv_heads, head_dim, block_size, fp8, gen,
                                       device)  # fmt: skip
    q = strided_q(len(seq_lens), heads, kv_heads, head_dim, dtype, gen, device)
    out = torch.full(q.shape, float("nan"), dtype=dtype, device=device)
    seq, scale = i32(seq_lens, device), head_dim**-0.5
    paged_attention_decode(q, kv[0], kv[1], out, seq, table, scale, max(seq_lens), num_splits,
                           k_scale=scales[0], v_scale=scales[1])  # fmt: skip
    ref = reference(q, deq[0], deq[1], [1] * len(seq_lens), seq_lens, table, scale)
    assert not out.isnan().any()
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("fp8", FP8)
def test_bf16_query_reads_fp8_as_f16(fp8, device):
    """The GPU default for a bf16 query (fp8_as_f16: the cache converted to fp16, q cast to
    fp16 saturated), forced here so the interpreter runs it too; a huge q stays finite."""
    gen = torch.Generator().manual_seed(3 + FP8.index(fp8))
    heads, kv_heads, head_dim, block_size = 8, 2, 64, 16
    seq_lens = [1, 16, 33, 150]
    kv, scales, deq, table = fp8_cache(seq_lens, kv_heads, head_dim, block_size, fp8, gen,
                                       device)  # fmt: skip
    q = strided_q(len(seq_lens), heads, kv_heads, head_dim, torch.bfloat16, gen, device)
    seq, scale = i32(seq_lens, device), head_dim**-0.5
    ref = reference(q, deq[0], deq[1], [1] * len(seq_lens), seq_lens, table, scale)
    for splits in (1, 3):
        out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=device)
        paged_attention_decode(q, kv[0], kv[1], out, seq, table, scale, max(seq_lens), splits,
                               k_scale=scales[0], v_scale=scales[1], f16=True)  # fmt: skip
        assert rel_err(out, ref) < TOL[torch.bfloat16]
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=device)
    qsl = i32(list(range(len(seq_lens) + 1)), device)  # one query per sequence: its last
    paged_attention_varlen(q, kv[0], kv[1], out, qsl, seq, table, scale, 1, max(seq_lens),
                           k_scale=scales[0], v_scale=scales[1], f16=True)  # fmt: skip
    assert rel_err(out, ref) < TOL[torch.bfloat16]
    q[0, 0, 0] = 1e30  # beyond fp16: saturated, not inf (whose scores would be nan)
    paged_attention_decode(q, kv[0], kv[1], out, seq, table, scale, max(seq_lens), 1,
                           k_scale=scales[0], v_scale=scales[1], f16=True)  # fmt: skip
    assert out.isfinite().all()


def test_write_then_attend_fp8(device):
    """reshape_and_cache into an fp8 cache -> prefill -> decode through the same cache: the
    torch reference over the same quantization, and close to the unquantized result."""
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, head_dim, block_size = 4, 2, 32, 16
    prompt = [20, 9]
    _, table = make_cache([21, 10], kv_heads, head_dim, block_size, torch.float32, gen, device)
    num_blocks = int(table.max()) + 1
    cache = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim,
                        dtype=torch.float8_e4m3fn, device=device)  # fmt: skip
    full = torch.zeros(cache.shape, device=device)  # the same K/V unquantized
    ks, vs = torch.tensor([0.02, 0.05], device=device), torch.tensor([0.01, 0.1], device=device)

    def slots(b: int, positions: range) -> list[int]:
        return [int(table[b, p // block_size]) * block_size + p % block_size for p in positions]

    def write(k, v, slot):
        reshape_and_cache(k, v, cache[0], cache[1], slot, ks, vs)
        reshape_and_cache(k, v, full[0], full[1], slot)

    def dequantized():
        return [dequantize(cache[i], s, torch.float32) for i, s in ((0, ks), (1, vs))]

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device)

    k, v = randn(sum(prompt), kv_heads, head_dim), randn(sum(prompt), kv_heads, head_dim)
    write(k, v, torch.tensor(slots(0, range(20)) + slots(1, range(9)), device=device))
    q = randn(sum(prompt), heads, head_dim)
    out = torch.empty_like(q)
    qsl, seq = i32([0, 20, 29], device), i32(prompt, device)
    paged_attention_varlen(q, cache[0], cache[1], out, qsl, seq, table, 0.25, 20, 20,
                           k_scale=ks, v_scale=vs)  # fmt: skip
    assert rel_err(out, reference(q, *dequantized(), prompt, prompt, table, 0.25)) < 2e-4
    assert rel_err(out, reference(q, full[0], full[1], prompt, prompt, table, 0.25)) < 0.1

    k1, v1 = randn(2, kv_heads, head_dim), randn(2, kv_heads, head_dim)
    write(k1, v1, torch.tensor(slots(0, range(20, 21)) + [-1], device=device))
    q1 = randn(1, heads, head_dim)
    out1 = torch.empty_like(q1)
    paged_attention_decode(q1, cache[0], cache[1], out1, i32([21], device), table[:1], 0.25, 21,
                           num_splits=2, k_scale=ks, v_scale=vs)  # fmt: skip
    assert rel_err(out1, reference(q1, *dequantized(), [1], [21], table, 0.25)) < 2e-4
    assert rel_err(out1, reference(q1, full[0], full[1], [1], [21], table, 0.25)) < 0.1


def test_scales_only_for_fp8(device):
    cache = torch.zeros(2, 1, 16, 1, 32, device=device)
    k = torch.zeros(1, 1, 32, device=device)
    with pytest.raises(AssertionError, match="fp8"):
        reshape_and_cache(k, k, cache[0], cache[1], torch.zeros(1, dtype=torch.long,
                          device=device), torch.ones(1, device=device))  # fmt: skip


@pytest.mark.slow  # 12 s: interpreted Triton through the engine, with the long checks
def test_engine_long_prompt_fp8_matches_hf(tiny_models, engines_on, interpreter_only):
    """The engine on the Triton backend (interpreted) with an fp8 cache: a prompt of many
    prefill chunks, then decode; greedy tokens equal HF's with its K/V rounded through fp8."""
    from kv_fp8_hf import hf_greedy_fp8
    from test_long_prompt import TritonOnCpu

    from paged import LLM, SamplingParams

    path = tiny_models["llama"]
    engines_on(TritonOnCpu())
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 320, (n,), generator=gen).tolist() for n in (130, 20)]
    llm = LLM(path, dtype="float32", max_model_len=512, max_num_batched_tokens=48,
              num_kv_blocks=64, kv_cache_dtype="fp8")  # fmt: skip
    assert llm.engine.runner.backend.name == "triton"
    assert llm.engine.runner.kv_caches[0].dtype == torch.float8_e4m3fn
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.engine.kv.check_invariants([])
    assert got == hf_greedy_fp8(path, prompts, 4, torch.float8_e4m3fn)


def test_backend_probes_fp8_at_start_up(monkeypatch, interpreter_only):
    """The Triton backend writes and reads a tiny fp8 cache when told to use one: a device
    whose Triton cannot convert fp8 is refused then, with the reason."""
    from paged.kernels.backend import TritonAttentionBackend

    def backend():
        return TritonAttentionBackend(4, 2, 32, 32**-0.5, 16, torch.float32, torch.device("cpu"))

    ok = backend()
    ok.use_cache_dtype(torch.float8_e5m2)
    assert ok.quantized_cache

    def fails(*args, **kwargs):
        raise RuntimeError("fp8e4nv not supported in this architecture")

    monkeypatch.setattr("paged.kernels.cache.reshape_and_cache", fails)
    why = "cannot store the KV cache as float8_e4m3fn on this device .RuntimeError: fp8e4nv"
    with pytest.raises(ValueError, match=why):
        backend().use_cache_dtype(torch.float8_e4m3fn)
