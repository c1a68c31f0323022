"""Mixture-of-experts routing in one kernel: softmax over the router logits, the top k, their
renormalisation and cast (paged.model.ops.moe_route's arithmetic). In torch these are five to
seven kernels a layer (softmax, a top-k sort and gather, a sum, a division, a cast), which at
batch 1 cost more than the experts' own GEMVs' share of a step."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _route_kernel(
    logits_ptr,  # [T, E]
    w_ptr,  # [T, TOP_K] out: routing weights
    ids_ptr,  # [T, TOP_K] out: expert ids (int64), by descending weight
    stride_l,
    E,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK_E: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    ok = e < E
    x = tl.load(logits_ptr + t * stride_l + e, mask=ok, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, 0))
    p = p / tl.sum(p, 0)  # softmax in float32, as torch.softmax(dtype=float)
    p = tl.where(ok, p, -1.0)
    kk = tl.arange(0, K_PAD)
    weights = tl.zeros((K_PAD,), dtype=tl.float32)
    ids = tl.zeros((K_PAD,), dtype=tl.int64)
    for j in tl.static_range(TOP_K):  # the largest left, lowest id first among equals
        best = tl.max(p, 0)
        idx = tl.min(tl.where(p == best, e, BLOCK_E), 0)
        idx = tl.minimum(idx, E - 1)  # NaN logits match nothing: still a valid expert
        weights = tl.where(kk == j, best, weights)
        ids = tl.where(kk == j, idx.to(tl.int64), ids)
        p = tl.where(e == idx, -1.0, p)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, 0)
    out = kk < TOP_K
    tl.store(w_ptr + t * TOP_K + kk, weights.to(w_ptr.dtype.element_ty), mask=out)
    tl.store(ids_ptr + t * TOP_K + kk, ids, mask=out)


def moe_route(
    logits: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in `dtype` (None: float32), expert ids [T, k] int64) from router logits
    [T, E]: softmax in float32, the top k by descending probability, optionally renormalised."""
    num_tokens, num_experts = logits.shape
    assert logits.stride(1) == 1 and 0 < top_k <= num_experts
    weights = logits.new_empty(num_tokens, top_k, dtype=dtype or torch.float32)
    ids = logits.new_empty(num_tokens, top_k, dtype=torch.int64)
    if num_tokens:
        block = triton.next_power_of_2(num_experts)
        _route_kernel[(num_tokens,)](
            logits, weights, ids, logits.stride(0), num_experts, TOP_K=top_k,
            K_PAD=triton.next_power_of_2(top_k), BLOCK_E=block, RENORMALIZE=renormalize,
            num_warps=1 if block <= 128 else 4,
        )  # fmt: skip
    return weights, ids
