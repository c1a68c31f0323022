"""Mixture-of-experts routing in one kernel: softmax over the router logits, the top k, their
renormalisation and cast (paged.model.ops.moe_route's arithmetic). In torch these are five to
seven kernels a layer (softmax, a top-k sort and gather, a sum, a division, a cast), which at
batch 1 cost more than the experts' own GEMVs' share of a step. `route_top_k` is the routing
of one token, shared with the decode expert GEMVs that route inline (paged.kernels.moe)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged.kernels import pdl

MAX_EXPERTS = 4096  # _fixed_sum's range


@triton.jit
def _fixed_sum(v):
    """Sum of values in [0, 1] (NaN as 0) in 2^-50 fixed point, rounded once to float32:
    integer adds give the same bits in any order, so every kernel routing a token agrees to
    the bit whatever its warps (a float sum's order follows the layout). <= MAX_EXPERTS values."""
    q = (tl.where(v == v, v, 0.0) * 1125899906842624.0).to(tl.int64)  # 2^50
    return tl.sum(q, 0).to(tl.float32) * 8.881784197001252e-16  # 2^-50


@triton.jit
def route_top_k(
    row_ptr,  # [E]: one token's router logits
    E,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK_E: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    """(weights float32, expert ids int64), [K_PAD] each and zero past TOP_K: softmax in
    float32, the k most probable by descending probability, the lowest id first among equals,
    optionally renormalised. One max a pick over 64-bit keys (the probability's bits, which
    order as the floats do when >= 0, then the id reversed). NaN logits still give ids < E."""
    e = tl.arange(0, BLOCK_E)
    ok = e < E
    x = tl.load(row_ptr + e, mask=ok, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, 0))
    p = p / _fixed_sum(p)
    key = (p.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (BLOCK_E - 1 - e)
    key = tl.where(ok, key, -(1 << 62))  # below every expert's, NaN's included
    kk = tl.arange(0, K_PAD)
    weights = tl.zeros((K_PAD,), dtype=tl.float32)
    ids = tl.zeros((K_PAD,), dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(key, 0)
        w = (best >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        weights = tl.where(kk == j, w, weights)
        ids = tl.where(kk == j, BLOCK_E - 1 - (best & (BLOCK_E - 1)), ids)
        key = tl.where(key == best, -(1 << 62), key)
    if RENORMALIZE:
        weights = weights / _fixed_sum(weights)
    return weights, ids


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
    PDL: tl.constexpr,
):
    pdl.enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    weights, ids = route_top_k(logits_ptr + t * stride_l, E, TOP_K, K_PAD, BLOCK_E, RENORMALIZE)
    kk = tl.arange(0, K_PAD)
    out = kk < TOP_K
    tl.store(w_ptr + t * TOP_K + kk, weights.to(w_ptr.dtype.element_ty), mask=out)
    tl.store(ids_ptr + t * TOP_K + kk, ids, mask=out)


def moe_route(
    logits: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in `dtype` (None: float32), expert ids [T, k] int64) from router logits
    [T, E]: softmax in float32, the top k by descending probability, optionally renormalised."""
    num_tokens, num_experts = logits.shape
    assert logits.stride(1) == 1 and 0 < top_k <= num_experts <= MAX_EXPERTS
    weights = logits.new_empty(num_tokens, top_k, dtype=dtype or torch.float32)
    ids = logits.new_empty(num_tokens, top_k, dtype=torch.int64)
    if num_tokens:
        block = triton.next_power_of_2(num_experts)
        _route_kernel[(num_tokens,)](
            logits, weights, ids, logits.stride(0), num_experts, TOP_K=top_k,
            K_PAD=triton.next_power_of_2(top_k), BLOCK_E=block, RENORMALIZE=renormalize,
            num_warps=1 if block <= 128 else 4, **pdl.launch()
        )  # fmt: skip
    return weights, ids
