"""Gemma's fused kernels (paged.kernels.gemma) against the torch references of
paged.model.ops: the (1 + w) RMSNorm, its residual-add variant and GeGLU."""

from collections import Counter

import pytest
import torch

from paged.kernels.gemma import gelu_and_mul, gemma_add_rms_norm, gemma_rms_norm
from paged.model import ops

DTYPES = [torch.float32, torch.bfloat16]
# bf16: up to two roundings (gelu, then the product; the sum, then the norm) of one ulp each:
# the CPU interpreter truncates fp32 -> bf16 where GPUs (and torch) round to nearest
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
EPS = 1e-6


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    return a.dtype == b.dtype and torch.allclose(a.float(), b.float(), rtol=TOL[dtype],
                                                 atol=TOL[dtype])  # fmt: skip


def rand(gen, *shape, scale=1.0):
    return torch.randn(*shape, generator=gen) * scale


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 3840), (7, 80), (5, 256), (0, 256), (256,)])
def test_gemma_rms_norm(dtype, shape, device):
    gen = torch.Generator().manual_seed(shape[-1])
    x = rand(gen, *shape, scale=3.0).to(device, dtype)
    w = rand(gen, shape[-1], scale=0.5).to(device, dtype)  # the norm scales by 1 + w
    out = gemma_rms_norm(x, w, EPS)
    assert out.shape == x.shape and close(out, ops.gemma_rms_norm(x, w, EPS), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma_rms_norm_heads(dtype, device):
    """Gemma 3's q/k norms: per-head rows of q [T, H, D] sliced out of the fused qkv."""
    gen = torch.Generator().manual_seed(0)
    t, heads, kv_heads, d = 3, 4, 2, 256
    qkv = rand(gen, t, (heads + 2 * kv_heads) * d).to(device, dtype)
    before = qkv.clone()
    q = qkv[:, : heads * d].reshape(t, heads, d)
    k = qkv[:, heads * d : (heads + kv_heads) * d].reshape(t, kv_heads, d)
    w = rand(gen, d, scale=0.5).to(device, dtype)
    for part in (q, k):
        out = gemma_rms_norm(part, w, EPS)
        assert out.shape == part.shape and close(out, ops.gemma_rms_norm(part, w, EPS), dtype)
    assert torch.equal(qkv, before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 3840), (7, 80), (0, 80), (2, 3, 96)])
def test_gemma_add_rms_norm(dtype, shape, device):
    gen = torch.Generator().manual_seed(shape[-1])
    x = rand(gen, *shape).to(device, dtype)
    res = rand(gen, *shape, scale=4.0).to(device, dtype)
    w = rand(gen, shape[-1], scale=0.5).to(device, dtype)
    x0, res0 = x.clone(), res.clone()
    expect_norm, expect_sum = ops.gemma_add_rms_norm(x, res, w, EPS)
    out, total = gemma_add_rms_norm(x, res, w, EPS)
    assert torch.equal(x, x0) and torch.equal(res, res0)  # inputs unchanged
    assert out.data_ptr() not in (x.data_ptr(), res.data_ptr()) or not x.numel()
    assert out.shape == total.shape == x.shape
    # the sum is exact in fp32 (the interpreter's bf16 rounding differs from torch's)
    assert (
        torch.equal(total, expect_sum)
        if dtype == torch.float32
        else close(total, expect_sum, dtype)
    )
    assert close(out, expect_norm, dtype)
    assert close(out, ops.gemma_rms_norm(total, w, EPS), dtype)  # the norm of what it stored


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["tanh", "none"])
@pytest.mark.parametrize("shape", [(3, 2 * 80), (2, 2 * 1536), (0, 2 * 80), (2, 3, 2 * 48)])
def test_gelu_and_mul(dtype, approximate, shape, device):
    gen = torch.Generator().manual_seed(shape[-1])
    x = rand(gen, *shape, scale=2.0).to(device, dtype)
    out = gelu_and_mul(x, approximate)
    assert out.shape == (*shape[:-1], shape[-1] // 2)
    assert close(out, ops.gelu_and_mul(x, approximate), dtype)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the interpreter's
def test_gelu_and_mul_extremes(device):
    """Large gates: no overflow to NaN (gelu(g) -> g for g >> 0 and -> 0 for g << 0)."""
    gate = torch.tensor([-60.0, -9.0, -3.0, -1e-3, 0.0, 1e-3, 3.0, 9.0, 60.0])
    x = torch.cat((gate, torch.full_like(gate, 2.0)))[None].to(device)
    for approximate in ("tanh", "none"):
        out = gelu_and_mul(x, approximate)
        assert not out.isnan().any()
        torch.testing.assert_close(out, ops.gelu_and_mul(x, approximate), rtol=1e-5, atol=1e-5)


def test_gemma3_engine_on_triton(tmp_path, monkeypatch, engines_on, interpreter_only):
    """A tiny Gemma 3 (q/k norms, sliding and global layers) on the engine with the Triton ops
    (interpreted): every norm and the MLP go through these kernels; greedy tokens equal HF's."""
    from test_hf_parity import hf_greedy
    from test_long_prompt import TritonOnCpu
    from test_models_gemma_phi import make_model
    from transformers import AutoModelForCausalLM

    import paged.kernels.gemma as kernels
    from paged import LLM, SamplingParams

    calls = Counter()

    def counted(name):
        fn = getattr(kernels, name)

        def run(*args):
            calls[name] += 1
            return fn(*args)

        return run

    for name in ("gemma_rms_norm", "gemma_add_rms_norm", "gelu_and_mul"):
        monkeypatch.setattr(kernels, name, counted(name))
    engines_on(TritonOnCpu())
    path = make_model("gemma3", str(tmp_path / "gemma3"))  # window 8
    prompts = [list(range(5, 25)), [7, 8, 9]]
    llm = LLM(path, dtype="float32", block_size=4, max_num_batched_tokens=16, num_kv_blocks=32,
              max_model_len=64)  # fmt: skip
    try:
        assert llm.engine.runner.backend.name == "triton"
        params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=1)
        outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.engine.shutdown()
    assert min(calls.values(), default=0) > 0 and len(calls) == 3, calls
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf_greedy(hf, prompt, 5)
        with torch.no_grad():  # and the logprobs, which see far smaller differences than argmax
            logits = hf(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1]
        expect = logits.log_softmax(-1)[range(5), out.token_ids]
        got = torch.tensor([lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)])
        torch.testing.assert_close(got, expect, rtol=0, atol=1e-4)
