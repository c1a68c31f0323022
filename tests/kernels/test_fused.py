"""Fused elementwise kernels against HF-style torch references."""

import pytest
import torch
import torch.nn.functional as F

from paged.kernels import fused_add_rms_norm, rms_norm, rotary_embedding, silu_and_mul

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    return torch.allclose(a.float(), b.float(), rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [96, 256])
def test_rms_norm(dtype, hidden, device):
    gen = torch.Generator().manual_seed(hidden)
    x = torch.randn(7, hidden, generator=gen).to(device, dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(device, dtype)
    out = rms_norm(x, w, 1e-6)
    assert close(out, hf_rms_norm(x, w, 1e-6), dtype)
    buf = torch.full_like(x, float("nan"))
    assert rms_norm(x, w, 1e-5, out=buf) is buf and close(buf, hf_rms_norm(x, w, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm(dtype, device):
    gen = torch.Generator().manual_seed(1)
    x, res, w = (torch.randn(n, generator=gen).to(device, dtype) for n in ((5, 160), (5, 160), 160))
    expect_res = x + res
    expect_x = hf_rms_norm(expect_res, w, 1e-6)
    x_out, res_out = fused_add_rms_norm(x, res, w, 1e-6)
    assert x_out.data_ptr() == x.data_ptr() and res_out.data_ptr() == res.data_ptr()
    # exact in fp32; the CPU interpreter truncates fp32 -> bf16 where GPUs round to nearest
    assert torch.equal(res, expect_res) if dtype == torch.float32 else close(res, expect_res, dtype)
    assert close(x, expect_x, dtype)


def hf_rotary(positions, x, cos_sin, head_dim):
    half = cos_sin.shape[1] // 2
    cos = cos_sin[positions, :half].repeat(1, 2)[:, None, :]
    sin = cos_sin[positions, half:].repeat(1, 2)[:, None, :]
    xf = x.float()
    rot, rest = xf[..., : 2 * half], xf[..., 2 * half :]
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), -1)
    return torch.cat((rot * cos + rotated * sin, rest), -1).to(x.dtype)


def cos_sin_cache(max_pos: int, rot_dim: int, base: float = 10000.0) -> torch.Tensor:
    inv = 1.0 / base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv)
    return torch.cat((freqs.cos(), freqs.sin()), -1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim,rot_dim", [(8, 2, 64, 64), (4, 4, 32, 16)])
def test_rotary_embedding(dtype, heads, kv_heads, head_dim, rot_dim, device):
    gen = torch.Generator().manual_seed(head_dim)
    tokens = 11
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(device, dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    positions = torch.randint(0, 100, (tokens,), generator=gen).to(device)
    cache = cos_sin_cache(128, rot_dim).to(device)
    expect_q = hf_rotary(positions, q, cache, head_dim)
    expect_k = hf_rotary(positions, k, cache, head_dim)
    rotary_embedding(positions, q, k, cache, head_dim)
    assert close(q, expect_q, dtype) and close(k, expect_k, dtype)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before)  # v untouched


def hf_gemma_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).to(x.dtype)


@pytest.mark.parametrize("gemma", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim,rot_dim", [(8, 2, 64, 64), (4, 2, 32, 16)])
def test_rotary_with_head_norm(dtype, heads, kv_heads, head_dim, rot_dim, gemma, device):
    """Qwen3's q_norm / k_norm (or Gemma 3's, `gemma`) fused before the rotary (every dim
    rotated), and the two-pass fallback for a partial rotary: both equal the norm per head,
    then the rotary."""
    gen = torch.Generator().manual_seed(head_dim + rot_dim)
    tokens = 9
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(device, dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    q_w = (1 + 0.3 * torch.randn(head_dim, generator=gen)).to(device, dtype)
    k_w = (1 + 0.3 * torch.randn(head_dim, generator=gen)).to(device, dtype)
    positions = torch.randint(0, 100, (tokens,), generator=gen).to(device)
    cache = cos_sin_cache(128, rot_dim).to(device)
    norm = hf_gemma_norm if gemma else hf_rms_norm
    expect_q = hf_rotary(positions, norm(q, q_w, 1e-6), cache, head_dim)
    expect_k = hf_rotary(positions, norm(k, k_w, 1e-6), cache, head_dim)
    got_q, got_k = rotary_embedding(positions, q, k, cache, head_dim, norm=(q_w, k_w, 1e-6),
                                    gemma_norm=gemma)  # fmt: skip
    assert close(got_q, expect_q, dtype) and close(got_k, expect_k, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [48, 2048])
def test_silu_and_mul(dtype, inter, device):
    gen = torch.Generator().manual_seed(inter)
    x = (3 * torch.randn(6, 2 * inter, generator=gen)).to(device, dtype)
    expect = F.silu(x[:, :inter]) * x[:, inter:]
    assert close(silu_and_mul(x), expect, dtype)
    out = torch.empty(6, inter, dtype=dtype, device=device)
    assert silu_and_mul(x, out) is out and close(out, expect, dtype)


@pytest.mark.parametrize("vocab,words", [(1000, 32), (1030, 32), (4100, 129)])
@pytest.mark.parametrize("with_rows", [False, True])
def test_apply_token_bitmask_matches_the_torch_default(vocab, words, with_rows, device):
    """The one-pass kernel against paged.model.ops' table path: rows by index (others
    untouched) or all in order, a vocabulary past the bitmask (ids there unchanged)."""
    from paged.kernels import apply_token_bitmask
    from paged.model.ops import apply_token_bitmask as torch_default

    gen = torch.Generator().manual_seed(vocab + words)
    logits = torch.randn(6 if with_rows else 4, vocab, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (4, words), generator=gen, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    bitmask[0] = -1  # every id allowed
    bitmask[1] = 0  # none
    rows = torch.tensor([5, 0, 3, 2]) if with_rows else None
    want = logits.clone()
    torch_default(want, bitmask, rows)
    got = logits.to(device)
    apply_token_bitmask(got, bitmask.to(device), rows.to(device) if with_rows else None)
    assert torch.equal(got.cpu(), want)
    assert torch.isinf(want).any() and not (with_rows and torch.isinf(want[1]).any())
