"""The fused-MoE Triton kernel against the grouped torch path (paged.model.ops.fused_moe), in
the interpreter on CPU: tiny shapes."""

import pytest
import torch

from paged.kernels import fused_moe
from paged.kernels.moe import align
from paged.kernels.moe_routing import moe_route
from paged.model.ops import fused_moe as torch_moe
from paged.model.ops import moe_route as route

TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def test_align_sorts_pairs_by_expert_in_padded_blocks():
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]])  # expert 1 gets nothing
    pairs, block_expert = align(ids, num_experts=4, block_m=4)
    n = ids.numel()
    # 3 blocks used (expert 0: 2 pairs, 2: 3, 3: 1), the rest marked past the last expert
    assert block_expert.tolist()[:3] == [0, 2, 3] and all(e >= 4 for e in block_expert[3:])
    rows = pairs.view(-1, 4)
    for b, e in enumerate(block_expert.tolist()[:3]):
        real = [p for p in rows[b].tolist() if p < n]
        assert real == sorted(real) and all(ids.view(-1)[p] == e for p in real)
    assert sorted(p for p in pairs.tolist() if p < n) == list(range(n))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# per-pair GEMVs (<= GEMV_MAX_PAIRS pairs, a K not a multiple of the tile), 16-row blocks
# (most experts hit once) and 64-row blocks
@pytest.mark.parametrize("tokens, experts, top_k, hidden, inter",
                         [(1, 8, 2, 40, 24), (5, 4, 2, 32, 16), (3, 6, 3, 48, 24),
                          (12, 16, 3, 32, 16), (40, 4, 2, 32, 16)])  # fmt: skip
def test_fused_moe_matches_torch(device, dtype, tokens, experts, top_k, hidden, inter):
    g = torch.Generator().manual_seed(tokens * experts)
    x = torch.randn(tokens, hidden, generator=g).to(device, dtype)
    w13 = (0.2 * torch.randn(experts, 2 * inter, hidden, generator=g)).to(device, dtype)
    w2 = (0.2 * torch.randn(experts, hidden, inter, generator=g)).to(device, dtype)
    logits = torch.randn(tokens, experts, generator=g).to(device)
    weights, ids = route(logits, top_k, renormalize=True, dtype=None)
    got = fused_moe(x, w13, w2, weights, ids)
    want = torch_moe(x, w13, w2, weights, ids)
    assert got.shape == want.shape and got.dtype == dtype
    assert torch.allclose(got.float(), want.float(), rtol=TOL[dtype], atol=TOL[dtype])


def test_fused_moe_no_tokens(device):
    x = torch.zeros(0, 32, device=device)
    w13, w2 = torch.ones(2, 32, 32, device=device), torch.ones(2, 32, 16, device=device)
    ids = torch.zeros(0, 1, dtype=torch.long, device=device)
    assert fused_moe(x, w13, w2, torch.zeros(0, 1, device=device), ids).shape == (0, 32)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("tokens, experts, top_k", [(1, 8, 2), (5, 60, 3), (3, 128, 8), (2, 4, 4)])
def test_routing_kernel_matches_torch(device, renormalize, dtype, tokens, experts, top_k):
    """Softmax, top k by descending weight, renormalisation and cast in one kernel: the same
    experts in the same order as torch.topk, the same weights (bf16 logits, as a bf16 gate
    gives them; a non-power-of-two expert count)."""
    g = torch.Generator().manual_seed(experts + top_k)
    logits = (3 * torch.randn(tokens, experts, generator=g)).to(device, torch.bfloat16)
    want_w, want_ids = route(logits, top_k, renormalize, dtype)
    got_w, got_ids = moe_route(logits, top_k, renormalize, dtype)
    assert got_ids.dtype == torch.int64 and got_w.dtype == (dtype or torch.float32)
    assert torch.equal(got_ids, want_ids)
    tol = 1e-6 if dtype is None else 1e-2
    assert torch.allclose(got_w.float(), want_w.float(), rtol=tol, atol=tol)


def test_routing_kernel_no_tokens_and_nan(device):
    w, ids = moe_route(torch.zeros(0, 8, device=device), 2, True, None)
    assert w.shape == ids.shape == (0, 2)
    bad = torch.full((1, 8), float("nan"), device=device)
    _, ids = moe_route(bad, 2, True, None)
    assert int(ids.min()) >= 0 and int(ids.max()) < 8  # still experts that exist
