"""Decode GEMVs: out [M, N] = x [M, K] @ weight [N, K]^T for a few rows (M <= 4), bound by
reading the weight once. One program computes BLOCK_N outputs of one row, stepping over K by
BLOCK_K with a [BLOCK_N, BLOCK_K] float32 accumulator reduced once at the end (no cross-lane
sum per step), so each step is a wide contiguous load of BLOCK_N weight rows.

The weight is bf16/fp16/fp32 (a plain linear) or fp8 with per-row or per-(row, K-group) scales.
For fp8 the activation is quantized per row to e4m3 inside the kernel exactly as
`fp8_gemm.quantize_fp8_rows` does (the row's absmax / 448, values rounded to e4m3): the same
arithmetic as the quantize-then-GEMM path, without a kernel launch and a round trip per linear.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from paged.kernels import pdl
from paged.kernels.compile_ahead import launcher
from paged.kernels.e4m3 import quantize_e4m3, token_scale
from paged.kernels.fused import silu_mul

MAX_ROWS = 4


@triton.jit
def _gemv_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, N, K, G, group_k, stride_xm, stride_wn,
    stride_om, QUANT_X: tl.constexpr, X_SCALED: tl.constexpr, W_SCALED: tl.constexpr,
    GROUPED: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    pdl.enter(PDL)
    pid_n = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    cols64 = cols.to(tl.int64)
    x_row = x_ptr + row * stride_xm
    x_scale = 1.0
    if QUANT_X:  # the row's per-token scale, as quantize_fp8_rows computes it
        amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(a))
        x_scale = token_scale(tl.max(amax, axis=0))
    if X_SCALED:  # x already quantized, its scale beside it
        x_scale = tl.load(xs_ptr + row)
    acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(x_row + ks, mask=k_ok, other=0.0).to(tl.float32)
        if QUANT_X:
            a = quantize_e4m3(a, x_scale)
        w = tl.load(w_ptr + cols64[:, None] * stride_wn + ks[None, :],
                    mask=col_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)  # fmt: skip
        if GROUPED:  # one weight scale per K step (BLOCK_K <= group_k)
            ws = tl.load(ws_ptr + cols64 * G + k0 // group_k, mask=col_ok, other=0.0)
            acc += tl.sum(w * a[None, :], axis=1) * ws
        else:
            acc2 += w * a[None, :]
    if not GROUPED:
        acc = tl.sum(acc2, axis=1)
        if W_SCALED:
            acc = acc * tl.load(ws_ptr + cols64 * G, mask=col_ok, other=0.0)
    acc = acc * x_scale
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


def check_group(group_k: int, grouped: bool) -> None:
    """Block scales step over K one group at a time: the group must be a power of 2 >= 16."""
    if grouped and (group_k & (group_k - 1) or group_k < 16):
        raise ValueError(f"fp8 block scales: group of {group_k} columns is not a power of 2 >= 16")


def gemv_config(n: int, k: int, itemsize: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, warps): the best measured on an H200 for Llama-3.1-8B's projections
    at one row (bench/gemv_gpu.py --sweep bf16,fp8): fp8 (16, 1024) up to 4096 outputs, else
    (32, 512); 16-bit weights (4, 512)."""
    if itemsize == 1:
        block_n, block_k = (16, 1024) if n <= 4096 else (32, 512)
    else:
        block_n, block_k = 4, 512
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    return min(block_n, max(1, triton.next_power_of_2(n))), block_k, 4


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None = None,
    group_k: int = 0,
    bias: torch.Tensor | None = None,
    *,
    quantize_x: bool = False,
    x_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS) times weight [N, K]^T. `scale` [N, G]: the fp8 weight's scales
    (G groups of `group_k` columns; G == 1 per row); `quantize_x`: x to e4m3 per row first (the
    fp8 linear's arithmetic); `x_scale` [M, 1]: x is already fp8 with these row scales."""
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    if m == 0:
        return out
    groups = scale.shape[1] if scale is not None else 1
    grouped = groups > 1
    block_n, block_k, warps = config or gemv_config(n, k, weight.element_size())
    check_group(group_k, grouped)
    if grouped:  # one weight scale per K step
        block_k = min(block_k, group_k)
    dummy = out
    _gemv_kernel[(triton.cdiv(n, block_n), m)](
        x, x_scale if x_scale is not None else dummy, weight,
        scale if scale is not None else dummy, bias if bias is not None else dummy, out,
        n, k, groups, max(group_k, 1), x.stride(0), weight.stride(0), out.stride(0),
        QUANT_X=quantize_x, X_SCALED=x_scale is not None, W_SCALED=scale is not None,
        GROUPED=grouped, HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, **pdl.launch()
    )  # fmt: skip
    return out


@triton.jit
def _gemv_split_k_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, ws_ptr, count_ptr, N, K, k_per_split, stride_xm, stride_wn,
    stride_om, res_ptr, g_ptr, res_out_ptr, ss_ptr, scale_ptr, eps, HAS_BIAS: tl.constexpr,
    NORM: tl.constexpr, SILU_MUL: tl.constexpr, W_SCALED: tl.constexpr, SPLIT: tl.constexpr,
    SPLIT_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One row's BLOCK_N outputs over one of SPLIT slices of K. With SPLIT > 1 each program
    writes its float32 partial sums, and the last program of a block (counted atomically) adds
    the SPLIT partials in slice order, stores the block and resets its counter: one launch,
    more programs than output blocks (small-N projections fill the GPU), the same sums in the
    same order whichever program finishes last.

    NORM: the input is RMSNorm(x + residual) * g, the residual add and the norm before a
    projection in one launch. Each program multiplies the weight by s * g (s = x + residual,
    rounded to x's dtype as the add would) and sums s^2 over its slice; the block's last
    program scales the summed products by rsqrt(mean(s^2) + eps) from the slices' sums, so no
    program reads the whole row. The programs of the first block write s (the new residual).

    SILU_MUL: x is a gated MLP's gate/up output [M, 2K] and the input is silu(gate) * up,
    rounded to x's dtype at each step as silu_and_mul rounds (the down projection and the
    activation before it in one launch).

    W_SCALED: the weight is fp8 with a float32 scale per output row at scale_ptr, applied to
    the finished sums (weight-only fp8: the input is not quantized).

    The first weight tile is loaded before anything else: under PDL (`pdl`) while the kernel
    before this one is still finishing (a slice of K is often a single tile)."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    row = tl.program_id(2).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    k_start = pid_s * k_per_split
    ks = k_start + tl.arange(0, BLOCK_K)
    w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & (ks < K)[None, :], other=0.0)
    pdl.enter(PDL)
    x_row = x_ptr + row * stride_xm
    acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    sq = tl.zeros((BLOCK_K,), dtype=tl.float32)
    acc2, sq = _split_k_step(x_row, res_ptr, g_ptr, res_out_ptr, row, K, ks, w, acc2, sq,
                             pid_n == 0, NORM, SILU_MUL)  # fmt: skip
    for k0 in range(k_start + BLOCK_K, k_start + k_per_split, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & (ks < K)[None, :], other=0.0)
        acc2, sq = _split_k_step(x_row, res_ptr, g_ptr, res_out_ptr, row, K, ks, w, acc2, sq,
                                 pid_n == 0, NORM, SILU_MUL)  # fmt: skip
    acc = tl.sum(acc2, axis=1)
    if SPLIT == 1:
        if NORM:
            acc = acc * tl.rsqrt(tl.sum(sq, 0) / K + eps)
        _store_row(acc, bias_ptr, scale_ptr, out_ptr + row * stride_om, cols, col_ok, HAS_BIAS,
                   W_SCALED)  # fmt: skip
    else:
        part = ws_ptr + row * SPLIT * N + cols
        tl.store(part + pid_s * N, acc, mask=col_ok)
        slot = row * tl.num_programs(0) + pid_n
        if NORM:  # this slice's sum of squares, beside its block's partials
            tl.store(ss_ptr + slot * SPLIT + pid_s, tl.sum(sq, 0))
        tl.debug_barrier()  # every thread's partial stored before the ticket (release)
        if tl.atomic_add(count_ptr + slot, 1) == SPLIT - 1:  # acq_rel: the partials visible
            total = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for s in tl.static_range(SPLIT):
                total += tl.load(part + s * N, mask=col_ok, other=0.0, cache_modifier=".cg")
            if NORM:
                split = tl.arange(0, SPLIT_PAD)
                ss = tl.load(ss_ptr + slot * SPLIT + split, mask=split < SPLIT, other=0.0,
                             cache_modifier=".cg")  # fmt: skip
                total = total * tl.rsqrt(tl.sum(ss, 0) / K + eps)
            tl.atomic_xchg(count_ptr + slot, 0)
            _store_row(total, bias_ptr, scale_ptr, out_ptr + row * stride_om, cols, col_ok,
                       HAS_BIAS, W_SCALED)  # fmt: skip


@triton.jit
def _split_k_step(x_row, res_ptr, g_ptr, res_out_ptr, row, K, ks, w, acc2, sq, first_block,
                  NORM: tl.constexpr, SILU_MUL: tl.constexpr):  # fmt: skip
    """One [BLOCK_N, BLOCK_K] weight tile `w` (columns `ks`) of _gemv_split_k_kernel times the
    input's slice (under NORM: s * g, s = x + residual, written out by the first block; under
    SILU_MUL: silu(gate) * up from x's two halves)."""
    k_ok = ks < K
    a = tl.load(x_row + ks, mask=k_ok, other=0.0).to(tl.float32)
    if SILU_MUL:  # silu_and_mul's arithmetic, its output rounded to the dtype
        up = tl.load(x_row + K + ks, mask=k_ok, other=0.0)
        a = silu_mul(a, up).to(up.dtype).to(tl.float32)
    if NORM:
        r = tl.load(res_ptr + row * K + ks, mask=k_ok, other=0.0).to(tl.float32)
        s = (a + r).to(x_row.dtype.element_ty)
        if first_block:
            tl.store(res_out_ptr + row * K + ks, s, mask=k_ok)
        a = s.to(tl.float32)
        sq += a * a
        a = a * tl.load(g_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
    acc2 += w.to(tl.float32) * a[None, :]
    return acc2, sq


@triton.jit
def _store_row(acc, bias_ptr, scale_ptr, out_row, cols, col_ok, HAS_BIAS: tl.constexpr,
               W_SCALED: tl.constexpr):  # fmt: skip
    if W_SCALED:
        acc = acc * tl.load(scale_ptr + cols, mask=col_ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(out_row + cols, acc.to(out_row.dtype.element_ty), mask=col_ok)


def split_k_counters(n: int, m: int, config: tuple[int, int, int, int]) -> int:
    """How many int32 counters `gemv_split_k` needs for [m, K] x [n, K]^T under `config`."""
    return m * triton.cdiv(n, config[0])


def gemv_split_k(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: tuple[int, int, int, int],
    counters: torch.Tensor,
    norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    silu_mul: bool = False,
    scale: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] @ weight [N, K]^T (+ bias) for 16/32-bit (or, with `scale`, fp8) weights, K
    split over `config`'s (BLOCK_N, BLOCK_K, SPLIT, warps). `counters`: int32 zeros, at least
    split_k_counters(); every launch leaves them zero again (so they can be shared, and
    captured in a graph).

    `norm` (residual [M, K], g [K], eps): the input is rms_norm(x + residual) * g instead of x
    (fused_add_rms_norm's arithmetic up to the order of the sums); returns (out, x + residual),
    the new residual in a new tensor (the inputs are not changed). `silu_mul`: x is [M, 2K],
    a gated MLP's gate/up, and the input is silu_and_mul(x) (not with `norm`). `scale` [N, 1]
    float32: the weight is fp8 with these per-row scales, x stays in its dtype (weight-only
    fp8 arithmetic; the fp8 linear proper quantizes x per token, fp8_gemv)."""
    m, k = x.shape
    n = weight.shape[0]
    if silu_mul:
        assert norm is None and x.stride(1) == 1 and k == 2 * weight.shape[1]
        k //= 2
    block_n, block_k, split, warps = config
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(x) if norm is not None else out
    if m == 0:
        return out if norm is None else (out, res_out)
    per = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    ws = torch.empty(m, split, n, dtype=torch.float32, device=x.device) if split > 1 else out
    assert split == 1 or counters.numel() >= split_k_counters(n, m, config)
    res, g, eps = norm if norm is not None else (out, out, 0.0)
    ss = out
    if scale is not None:
        assert scale.shape == (n, 1) and scale.dtype == torch.float32 and scale.is_contiguous()
    if norm is not None:
        assert res.shape == x.shape and res.is_contiguous() and x.stride(1) == 1
        if split > 1:  # each slice's sum of squares, per output block
            ss = torch.empty(split_k_counters(n, m, config) * split, dtype=torch.float32,
                             device=x.device)  # fmt: skip
    launcher(_gemv_split_k_kernel, (triton.cdiv(n, block_n), split, m))(
        x, weight, bias if bias is not None else out, out, ws, counters, n, k, per, x.stride(0),
        weight.stride(0), out.stride(0), res, g, res_out, ss,
        scale if scale is not None else out, eps, HAS_BIAS=bias is not None,
        NORM=norm is not None, SILU_MUL=silu_mul, W_SCALED=scale is not None, SPLIT=split,
        SPLIT_PAD=triton.next_power_of_2(split), BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, **pdl.launch(),
    )  # fmt: skip
    return out if norm is None else (out, res_out)


@triton.jit
def _fp8_gemv_dot_kernel(
    x_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """fp8 weights with per-row scales on the tensor cores, operands swapped: a
    [BLOCK_N, BLOCK_K] weight tile times the activations' [BLOCK_K, 16] (the dot's least
    width). Only ROWS (M rounded up to a power of 2) rows are loaded and quantized per token;
    each fills 16 / ROWS adjacent columns of the dot, and the first of them is stored."""
    pdl.enter(PDL)
    REP: tl.constexpr = 16 // ROWS
    pid_n = tl.program_id(0)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    cols64 = cols.to(tl.int64)
    r = tl.arange(0, ROWS)
    r_ok = r < M
    x_rows = x_ptr + r.to(tl.int64)[:, None] * stride_xm
    amax = tl.zeros((ROWS, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_rows + ks[None, :], mask=r_ok[:, None] & (ks < K)[None, :], other=0.0)
        amax = tl.maximum(amax, tl.abs(a.to(tl.float32)))
    x_scale = token_scale(tl.max(amax, axis=1))  # [ROWS]
    acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(x_rows + ks[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        q = quantize_e4m3(a.to(tl.float32), x_scale[:, None])
        q16 = tl.reshape(tl.broadcast_to(q[:, None, :], (ROWS, REP, BLOCK_K)), (16, BLOCK_K))
        w = tl.load(w_ptr + cols64[:, None] * stride_wn + ks[None, :],
                    mask=col_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        acc += tl.dot(w, tl.trans(q16.to(w.dtype)), out_dtype=tl.float32)
    c = tl.arange(0, 16)
    row = c // REP
    xs16 = tl.reshape(tl.broadcast_to(x_scale[:, None], (ROWS, REP)), (16,))
    acc = acc * tl.load(ws_ptr + cols64, mask=col_ok, other=0.0)[:, None] * xs16[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[:, None]
    ptrs = out_ptr + row.to(tl.int64)[None, :] * stride_om + cols64[:, None]
    ok = col_ok[:, None] & ((row < M) & (c % REP == 0))[None, :]
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=ok)


DOT_WIDTH = 16  # the dot's activation columns: fp8_gemv_dot takes up to 16 rows
DOT_MAX_ROWS = 4  # where fp8_linear uses it: at 16 rows quant + GEMM is faster (H200)


@functools.cache
def _shared_memory(device: int) -> int:
    return triton.runtime.driver.active.utils.get_device_properties(device)["max_shared_mem"]


def dot_config(n: int, k: int, device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, stages), the best measured on an H200 for Llama-3.1-8B's
    projections (bench/gemv_gpu.py --sweep fp8dot), with fewer stages where shared memory
    is smaller (Ada: 99 KB)."""
    block_n, block_k, stages = (128, 256, 3) if n >= 16384 else (64, 512, 4)
    block_k = min(block_k, max(32, triton.next_power_of_2(k)))
    if device.type not in ("cpu", "meta"):  # meta: compiling without a device (tests)
        smem = _shared_memory(device.index or 0)
        while stages > 1 and stages * (block_n + DOT_WIDTH) * block_k > smem - 8192:
            stages -= 1
    return block_n, block_k, 4, stages


def fp8_gemv_dot(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """The fp8 linear (per-row weight scales, x quantized per token) for up to 16 rows on the
    tensor cores. `config`: (BLOCK_N, BLOCK_K, warps, pipeline stages)."""
    m, k = x.shape
    n = weight.shape[0]
    assert scale.shape[1] == 1 and m <= DOT_WIDTH
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_n, block_k, warps, stages = config or dot_config(n, k, x.device)
    launcher(_fp8_gemv_dot_kernel, (triton.cdiv(n, block_n),))(
        x, weight, scale, bias if bias is not None else out, out, m, n, k, x.stride(0),
        weight.stride(0), out.stride(0), HAS_BIAS=bias is not None,
        ROWS=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
        num_stages=stages, **pdl.launch()
    )  # fmt: skip
    return out


class OneRowGemv:
    """A Linear's forward on the split-K GEMV for one-row inputs (a measured choice: the CUDA
    plugin's gemv_select installs it per weight shape), the module's forward before it
    otherwise. With `norm` it also runs the residual add and RMSNorm before the projection
    (gemv_split_k's `norm`); with `silu_mul`, SiLU-and-mul of a gate/up output before it.
    `scale`: the module's weight is fp8 with these per-row scales, run weight-only (the input
    not quantized: paged_cuda.fp8_weight_only). `fold` False: the op before runs as its own
    kernel (a measured choice: where computing it in every program costs more than a launch)."""

    def __init__(self, mod: torch.nn.Module, config: tuple[int, int, int, int], counters,
                 scale: torch.Tensor | None = None, fold: bool = True) -> None:  # fmt: skip
        self.weight, self.bias, self.config, self.counters = mod.weight, mod.bias, config, counters
        self.scale, self.fold = scale, fold
        # what runs the other inputs: an earlier measured choice on the module, or its class's
        self.fallback = vars(mod).get("forward") or functools.partial(type(mod).forward, mod)

    @staticmethod
    def takes(x: torch.Tensor) -> bool:
        return x.dim() == 2 and x.shape[0] == 1 and x.stride(1) == 1

    def folds(self, x: torch.Tensor) -> bool:
        """Whether the op before the linear is to be folded into its GEMV for input x."""
        return self.fold and self.takes(x)

    def __call__(self, x: torch.Tensor, norm=None, silu_mul: bool = False):
        if self.takes(x):
            return gemv_split_k(x, self.weight, self.bias, self.config, self.counters, norm,
                                silu_mul, self.scale)  # fmt: skip
        assert norm is None and not silu_mul, "the fused input op needs a one-row input"
        return self.fallback(x)
