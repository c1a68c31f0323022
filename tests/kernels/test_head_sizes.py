"""Head sizes that are not powers of two (Phi-3's 96, 80, 112): the Triton kernels mask the
head dim to the next power of two; against the float64 reference, tiny shapes (interpreter)."""

import pytest
import torch
from test_attention import TOL, i32, make_cache, reference, rel_err
from test_fused import close, cos_sin_cache, hf_rotary

from paged.kernels import (
    paged_attention_decode,
    paged_attention_varlen,
    reshape_and_cache,
    rotary_embedding,
)

HEAD_DIMS = [80, 96]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_varlen(head_dim, dtype, device):
    gen = torch.Generator().manual_seed(head_dim)
    seq_lens, query_lens = [9, 20], [9, 4]  # a prefill and a chunk over cached context
    kv, table = make_cache(seq_lens, 2, head_dim, 8, dtype, gen, device)
    q = torch.randn(sum(query_lens), 4, head_dim, generator=gen).to(device, dtype)
    out = torch.full_like(q, float("nan"))
    qsl = i32([0, 9, 13], device)
    paged_attention_varlen(q, kv[0], kv[1], out, qsl, i32(seq_lens, device), table, 0.1, 9, 20)
    ref = reference(q, kv[0], kv[1], query_lens, seq_lens, table, 0.1)
    assert not out.isnan().any()
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_decode(head_dim, num_splits, device):
    gen = torch.Generator().manual_seed(head_dim + num_splits)
    seq_lens = [5, 30]
    kv, table = make_cache(seq_lens, 2, head_dim, 8, torch.float32, gen, device)
    q = torch.randn(2, 4, head_dim, generator=gen).to(device)
    out = torch.full_like(q, float("nan"))
    seq = i32(seq_lens, device)
    paged_attention_decode(q, kv[0], kv[1], out, seq, table, 0.1, 30, num_splits)
    ref = reference(q, kv[0], kv[1], [1, 1], seq_lens, table, 0.1)
    assert not out.isnan().any()
    assert rel_err(out, ref) < TOL[torch.float32]


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_cache_write_stays_in_its_head(head_dim, device):
    """The masked tail of a head must not spill into the next head or slot."""
    gen = torch.Generator().manual_seed(head_dim)
    k = torch.randn(3, 2, head_dim, generator=gen).to(device)
    v = torch.randn(3, 2, head_dim, generator=gen).to(device)
    cache = torch.full((2, 2, 4, 2, head_dim), float("nan"), device=device)
    slots = torch.tensor([5, -1, 2], device=device)
    reshape_and_cache(k, v, cache[0], cache[1], slots)
    flat = cache.view(2, 8, 2, head_dim)
    assert torch.equal(flat[0, 5], k[0]) and torch.equal(flat[1, 5], v[0])
    assert torch.equal(flat[0, 2], k[2]) and torch.equal(flat[1, 2], v[2])
    untouched = [s for s in range(8) if s not in (2, 5)]
    assert flat[:, untouched].isnan().all()


@pytest.mark.parametrize("head_dim,rot_dim", [(80, 80), (96, 96), (96, 48)])
def test_rotary(head_dim, rot_dim, device):
    gen = torch.Generator().manual_seed(head_dim + rot_dim)
    q = torch.randn(3, 4, head_dim, generator=gen).to(device)
    k = torch.randn(3, 2, head_dim, generator=gen).to(device)
    positions = torch.tensor([0, 7, 31], device=device)
    cache = cos_sin_cache(32, rot_dim).to(device)
    expect_q = hf_rotary(positions, q, cache, head_dim)
    expect_k = hf_rotary(positions, k, cache, head_dim)
    rotary_embedding(positions, q, k, cache, head_dim)
    assert close(q, expect_q, torch.float32) and close(k, expect_k, torch.float32)


def test_unsupported_head_size_is_refused_before_a_kernel(device):
    from paged.kernels.backend import TritonAttentionBackend

    with pytest.raises(ValueError, match="head size 512"):
        TritonAttentionBackend(4, 2, 512, 0.1, 16, torch.float32, torch.device(device))
    for head_dim in (64, 80, 96, 112, 128, 256):  # accepted
        TritonAttentionBackend(4, 2, head_dim, 0.1, 16, torch.float32, torch.device(device))
