"""Fused mixture-of-experts MLP: the (token, choice) pairs sorted by expert, then one grouped
GEMM over all experts for gate/up, SiLU-and-mul, and one for down weighted by the router.

`align()` lays the T*k pairs out expert by expert, each expert's run padded to a multiple of
BLOCK_M rows, and gives each block of BLOCK_M rows its expert; a program of `_grouped_gemm`
multiplies one block's rows by one BLOCK_N slice of its expert's matrix. Every size is an upper
bound known from T, k and E, so nothing waits for the device (CUDA graphs can capture it);
blocks past the last expert's run exit at once. The k outputs of a token are summed last.
Decode-sized steps (at most GEMV_MAX_PAIRS pairs) skip the sorting: matrix-vector products per
pair and BLOCK_N outputs with silu-and-mul fused for gate/up, then one program per token and
BLOCK_N outputs runs all k experts' down rows, weights them and sums them. `fused_moe_from_logits`
routes too: at decode sizes each program of the two GEMVs routes its token itself
(moe_routing.route_top_k, from the router logits in L2), two launches where the routing kernel
made three; larger steps run moe_route, then fused_moe. With `norm` the residual add and
RMSNorm before the layer are folded into the gate/up GEMV as well. Both measured slower on an
H200 than the routing kernel and the norm kernel before the GEMVs (every program routes before
its first weight load), so the op table does not use them (paged.kernels.ops).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from paged.kernels import moe_routing, pdl
from paged.kernels.fused import rms_norm, silu_and_mul, silu_mul
from paged.kernels.moe_routing import route_top_k


@triton.jit
def _grouped_gemm(
    a_ptr,  # [rows of A, K]: x (rows = pair // TOP_K) or the activations (rows = pair)
    b_ptr,  # [E, N, K]: the experts' weights
    c_ptr,  # [T * top_k, N]: one output row per (token, choice) pair
    w_ptr,  # [T * top_k]: routing weights (read when MUL_WEIGHT)
    pairs_ptr,  # [blocks * BLOCK_M]: pair index of each sorted row, n_pairs for padding
    block_expert_ptr,  # [blocks]: expert of each block, >= num_experts past the end
    n_pairs,
    num_experts,
    N,
    K,
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    TOP_K: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert >= num_experts:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pairs_ptr + rows).to(tl.int64)
    valid = pairs < n_pairs
    a_rows = pairs // TOP_K
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    b_base = b_ptr + expert * stride_be
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + ks[None, :],
                    mask=valid[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        b = tl.load(b_base + cols[None, :] * stride_bn + ks[:, None],
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # fmt: skip
        if UPCAST:  # the CPU interpreter multiplies bf16 storage (uint16) as ints
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if IEEE:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    if MUL_WEIGHT:
        # HF rounds the expert's output to the model dtype before weighting it
        acc = acc.to(c_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + pairs, mask=valid, other=0.0).to(tl.float32)
        acc = acc * w[:, None]
    tl.store(c_ptr + pairs[:, None] * stride_cm + cols[None, :],
             acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])  # fmt: skip


@triton.jit
def _pair_gemv(
    a_ptr,  # [T, K]: x (row = pair // TOP_K)
    b_ptr,  # [E, 2N, K]: the experts' gate rows, then up rows
    c_ptr,  # [T * top_k, N]: one output row per (token, choice) pair
    ids_ptr,  # [T * top_k]: the expert of each pair (unless ROUTE)
    logits_ptr,  # [T, E]: router logits (ROUTE)
    res_ptr,  # [T, K]: the residual (NORM)
    g_ptr,  # [K]: the norm's gain (NORM)
    eps,
    N,
    K,
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    stride_l,
    stride_rm,
    E,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK_E: tl.constexpr,
    ROUTE: tl.constexpr,
    NORM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """Decode: one (token, choice) pair's BLOCK_N outputs of silu(gate) * up of its expert,
    matrix-vector products (no sorting by expert). [BLOCK_N, BLOCK_K] float32 accumulators
    summed once at the end (no cross-lane sum per step). ROUTE: the expert from the token's
    router logits (route_top_k) instead of ids_ptr.

    NORM: the input is rms_norm(x + residual) * g (add_rms_norm_moe). Each step multiplies
    the weights by s * g (s = x + residual rounded to x's dtype, as the add rounds it) and
    adds s^2 to the row's sum of squares from the values it loaded anyway (the program
    covers all of K: no second pass, nothing before the first weight load); the sums are
    scaled by rsqrt(mean(s^2) + eps) once at the end."""
    pdl.enter(PDL)
    pair = tl.program_id(0)
    row = pair // TOP_K
    if ROUTE:
        _, ids = route_top_k(logits_ptr + row.to(tl.int64) * stride_l, E, TOP_K, K_PAD,
                             BLOCK_E, False)  # fmt: skip
        expert = tl.sum(tl.where(tl.arange(0, K_PAD) == pair % TOP_K, ids, 0), 0)
    else:
        expert = tl.load(ids_ptr + pair).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    b_base = b_ptr + expert * stride_be
    gate2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    up2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    sq = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(a_ptr + row * stride_am + ks, mask=k_ok, other=0.0).to(tl.float32)
        if NORM:
            r = tl.load(res_ptr + row * stride_rm + ks, mask=k_ok, other=0.0).to(tl.float32)
            a = (a + r).to(a_ptr.dtype.element_ty).to(tl.float32)
            sq += a * a
            a = a * tl.load(g_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
        tile = b_base + cols[:, None] * stride_bn + ks[None, :]
        ok = col_ok[:, None] & k_ok[None, :]
        gate2 += tl.load(tile, mask=ok, other=0.0).to(tl.float32) * a[None, :]
        up2 += tl.load(tile + N * stride_bn, mask=ok, other=0.0).to(tl.float32) * a[None, :]
    gate = tl.sum(gate2, axis=1)
    up = tl.sum(up2, axis=1)
    if NORM:
        inv = tl.rsqrt(tl.sum(sq, 0) / K + eps)
        gate, up = gate * inv, up * inv
    dtype = c_ptr.dtype.element_ty
    # rounded where HF's bf16 activations round: gate, up, silu(gate), product
    acc = silu_mul(gate.to(dtype), up.to(dtype))
    tl.store(c_ptr + pair * stride_cm + cols, acc.to(dtype), mask=col_ok)


@triton.jit
def _down_gemv_sum(
    a_ptr,  # [T * TOP_K, K]: the activations, one row per (token, choice) pair
    b_ptr,  # [E, N, K]: the experts' down projections
    c_ptr,  # [T, N]: per token, the sum over its k pairs
    w_ptr,  # [T * TOP_K]: routing weights (unless ROUTE)
    ids_ptr,  # [T * TOP_K]: the expert of each pair (unless ROUTE)
    logits_ptr,  # [T, E]: router logits (ROUTE)
    N,
    K,
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    stride_l,
    E,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK_E: tl.constexpr,
    ROUTE: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    CAST_W: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """Decode: BLOCK_N outputs of one token's down projection, all its k experts in one
    program ([K_PAD, BLOCK_N, BLOCK_K] tiles a step), each weighted, then summed: the k
    outputs never leave the program (no [T, k, N] buffer and no separate sum). ROUTE: experts
    and weights from the token's router logits (route_top_k), the weights rounded to the
    output's dtype when CAST_W (as moe_route's dtype rounds them)."""
    pdl.enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, K_PAD)
    j_ok = j < TOP_K
    pairs = t * TOP_K + j
    dtype = c_ptr.dtype.element_ty
    if ROUTE:
        w, experts = route_top_k(logits_ptr + t * stride_l, E, TOP_K, K_PAD, BLOCK_E,
                                 RENORMALIZE)  # fmt: skip
        if CAST_W:
            w = w.to(dtype).to(tl.float32)
    else:
        experts = tl.load(ids_ptr + pairs, mask=j_ok, other=0).to(tl.int64)
        w = tl.load(w_ptr + pairs, mask=j_ok, other=0.0).to(tl.float32)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    acc3 = tl.zeros((K_PAD, BLOCK_N, BLOCK_K), dtype=tl.float32)
    rows = b_ptr + experts[:, None, None] * stride_be + cols[None, :, None] * stride_bn
    row_ok = j_ok[:, None, None] & col_ok[None, :, None]
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(a_ptr + pairs[:, None] * stride_am + ks[None, :],
                    mask=j_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)  # fmt: skip
        b = tl.load(rows + ks[None, None, :], mask=row_ok & k_ok[None, None, :], other=0.0)
        acc3 += b.to(tl.float32) * a[:, None, :]
    # rounded as the per-pair path and HF round: the expert's output, then its weighted copy
    y = (tl.sum(acc3, axis=2).to(dtype).to(tl.float32) * w[:, None]).to(dtype).to(tl.float32)
    tl.store(c_ptr + t * stride_cm + cols, tl.sum(y, axis=0).to(dtype), mask=col_ok)


def gemv_config(n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, warps) of the per-pair gate/up GEMV: the best on an H200 for a
    Qwen3-30B-A3B layer (bench/moe_kernel.py --sweep): many short programs of 8 warps."""
    return min(8, triton.next_power_of_2(n)), min(128, max(16, triton.next_power_of_2(k))), 8


def down_sum_config(n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, warps) of the summing down GEMV: the best on an H200 for a
    Qwen3-30B-A3B layer (bench/moe_kernel.py --sweep: 8.4 us, 3.0 TB/s, one token)."""
    return min(2, triton.next_power_of_2(n)), min(128, max(16, triton.next_power_of_2(k))), 4


class Route(NamedTuple):
    """Routing inside the decode GEMVs: the router logits [T, E] and moe_route's options."""

    logits: torch.Tensor
    renormalize: bool
    cast: bool  # weights rounded to the output's dtype (moe_route's dtype = x.dtype)


Norm = tuple[torch.Tensor, torch.Tensor, float]  # an RMSNorm folded in: (residual, gain, eps)


def _routing(route: Route | None, top_k: int) -> dict[str, Any]:
    """The GEMVs' routing arguments: from `route`, or none (ids and weights given)."""
    k_pad = triton.next_power_of_2(top_k)
    if route is None:
        return dict(logits_ptr=None, stride_l=0, E=0, K_PAD=k_pad, BLOCK_E=1, ROUTE=False)
    logits = route.logits
    assert logits.stride(1) == 1 and top_k <= logits.shape[1] <= moe_routing.MAX_EXPERTS
    return dict(logits_ptr=logits, stride_l=logits.stride(0), E=logits.shape[1], K_PAD=k_pad,
                BLOCK_E=triton.next_power_of_2(logits.shape[1]), ROUTE=True)  # fmt: skip


def _down_sum(a, b, c, weights, ids, top_k: int, cfg=None, route: Route | None = None) -> None:
    n, k = c.shape[1], a.shape[1]
    block_n, block_k, warps = cfg or down_sum_config(n, k)
    _down_gemv_sum[(c.shape[0], triton.cdiv(n, block_n))](
        a, b, c, weights, ids, N=n, K=k, stride_am=a.stride(0), stride_be=b.stride(0),
        stride_bn=b.stride(1), stride_cm=c.stride(0), TOP_K=top_k, **_routing(route, top_k),
        RENORMALIZE=route is not None and route.renormalize,
        CAST_W=route is not None and route.cast, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, **pdl.launch()
    )  # fmt: skip


def _gate_up(a, b, c, ids, top_k: int, cfg=None, route: Route | None = None,
             norm: Norm | None = None) -> None:  # fmt: skip
    """`norm`: the input is rms_norm(a + residual) * gain (_pair_gemv's NORM)."""
    n, k = c.shape[1], a.shape[1]
    block_n, block_k, warps = cfg or gemv_config(n, k)
    res, g, eps = norm if norm is not None else (None, None, 0.0)
    if res is not None:
        assert res.shape == a.shape and res.stride(1) == 1 and g.is_contiguous()
    _pair_gemv[(c.shape[0], triton.cdiv(n, block_n))](
        a, b, c, ids, res_ptr=res, g_ptr=g, eps=eps, N=n, K=k, stride_am=a.stride(0),
        stride_be=b.stride(0), stride_bn=b.stride(1), stride_cm=c.stride(0),
        stride_rm=res.stride(0) if res is not None else 0, TOP_K=top_k,
        **_routing(route, top_k), NORM=res is not None, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, **pdl.launch()
    )  # fmt: skip


GEMV_MAX_PAIRS = 32  # up to this many (token, choice) pairs: per-pair GEMVs, no sorting


def align(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(pairs, block_expert): pair indices (t * k + choice) sorted by expert, each expert's run
    padded with n_pairs to a multiple of block_m; the expert of every block (num_experts for
    the unused blocks at the end). Sizes are upper bounds: no device-to-host sync."""
    flat = topk_ids.reshape(-1)
    n = flat.numel()
    dev = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat.long(), torch.ones_like(flat, dtype=torch.int64))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = padded.cumsum(0)
    num_blocks = (n + num_experts * (block_m - 1) + block_m - 1) // block_m
    order = flat.argsort(stable=True)
    expert_of = flat[order].long()
    rank = torch.arange(n, device=dev) - (counts.cumsum(0) - counts)[expert_of]
    pairs = torch.full((num_blocks * block_m,), n, dtype=torch.int64, device=dev)
    pairs[(pad_end - padded)[expert_of] + rank] = order
    blocks = torch.arange(num_blocks, device=dev)
    block_expert = torch.searchsorted(pad_end // block_m, blocks, right=True)
    return pairs, block_expert


def _gemm(a, b, c, weights, pairs, block_expert, top_k: int, block_m: int) -> None:
    num_experts, n, k = b.shape
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    cpu = a.device.type == "cpu"  # the interpreter
    _grouped_gemm[grid](
        a, b, c, weights, pairs, block_expert, c.shape[0], num_experts, n, k,
        a.stride(0), b.stride(0), b.stride(1), c.stride(0),
        TOP_K=top_k, MUL_WEIGHT=weights is not None, IEEE=a.dtype == torch.float32 or cpu,
        UPCAST=cpu and a.dtype != torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )  # fmt: skip


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """paged.model.ops.fused_moe on the device: x [T, H], w13 [E, 2I, H], w2 [E, H, I],
    topk_weights / topk_ids [T, k] -> [T, H]."""
    num_tokens, top_k = topk_ids.shape
    hidden = x.shape[1]
    if num_tokens == 0:
        return torch.zeros_like(x)
    assert x.stride(1) == 1 and w13.stride(2) == 1 and w2.stride(2) == 1
    n_pairs = num_tokens * top_k
    weights = topk_weights.reshape(-1).contiguous()
    if n_pairs <= GEMV_MAX_PAIRS:  # decode: each pair reads its expert's weights once
        ids = topk_ids.reshape(-1).contiguous()
        act = x.new_empty(n_pairs, w13.shape[1] // 2)
        _gate_up(x, w13, act, ids, top_k)
        out = x.new_empty(num_tokens, hidden)
        _down_sum(act, w2, out, weights, ids, top_k)
        return out
    block_m = 16 if n_pairs <= 4 * w13.shape[0] else 64  # few rows per expert
    pairs, block_expert = align(topk_ids, w13.shape[0], block_m)
    gate_up = x.new_empty(n_pairs, w13.shape[1])
    _gemm(x, w13, gate_up, None, pairs, block_expert, top_k, block_m)
    act = silu_and_mul(gate_up)
    down = x.new_empty(n_pairs, hidden)
    _gemm(act, w2, down, weights, pairs, block_expert, 1, block_m)
    return down.view(num_tokens, top_k, hidden).sum(dim=1)


def fused_moe_from_logits(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    weight_dtype: torch.dtype | None,
    norm: Norm | None = None,
) -> torch.Tensor:
    """fused_moe(x, w13, w2, *moe_route(router_logits, top_k, renormalize, weight_dtype)), to
    the bit. Decode sizes (<= GEMV_MAX_PAIRS pairs) route inside the two GEMVs: one launch
    fewer a layer (~2 us in a CUDA graph), the router logits read from L2 by every program.

    `norm` (residual, g, eps): the experts' input is rms_norm(x + residual) * g instead of x
    (add_rms_norm_moe), folded into the gate/up GEMV at decode sizes (one norm kernel fewer;
    the normed input is not rounded to x's dtype, as gemv_split_k's norm) and run first
    otherwise. Neither x nor the residual is changed."""
    n_pairs = router_logits.shape[0] * top_k
    cast = weight_dtype not in (None, torch.float32)
    if not 0 < n_pairs <= GEMV_MAX_PAIRS or (cast and weight_dtype != x.dtype):
        if norm is not None:
            residual, g, eps = norm
            x = rms_norm(x + residual, g, eps)
        weights, ids = moe_routing.moe_route(router_logits, top_k, renormalize, weight_dtype)
        return fused_moe(x, w13, w2, weights, ids)
    assert x.stride(1) == 1 and w13.stride(2) == 1 and w2.stride(2) == 1
    route = Route(router_logits, renormalize, cast)
    act = x.new_empty(n_pairs, w13.shape[1] // 2)
    _gate_up(x, w13, act, None, top_k, route=route, norm=norm)
    out = torch.empty_like(x)
    _down_sum(act, w2, out, None, None, top_k, route=route)
    return out
