"""The fp8 decode GEMV split over K: `gemv.fp8_gemv_dot`'s arithmetic (fp8 weights with
per-row scales, the rows quantized per token to e4m3 inside, the product on the tensor cores
with the operands swapped) on a grid of (output blocks, SPLIT slices of K). A projection with
few output blocks (Llama-3.1-8B's o_proj and down: 64 blocks of 64 rows) fills the GPU's SMs
only when K is split too.

Every program reads the whole rows for their absmax (the token's scale, as the unsplit kernel
computes it; or takes it from the op's kernel, X_AMAX), quantizes its slice of them
and multiplies its slice of the weight; it writes float32 partial sums, and the last program
of an output block (counted atomically) adds the SPLIT partials in slice order, scales them,
adds the bias, stores the block and resets its counter. So the result is the unsplit
kernel's up to the float32 order of the sums, and the same whichever program finishes last.

The op before a decode projection can be folded in, as gemv.gemv_split_k does for 16-bit
weights: NORM (the input is RMSNorm(x + residual) * g, fused_add_rms_norm's arithmetic) or
SILU_MUL (the input is silu_and_mul of a gate/up output). Every program needs the whole input
rows for their absmax anyway, so it computes them itself: under NORM a first pass sums the
squares of x + residual (the first program writes that sum out, the new residual), then the
absmax pass and the K slice compute the normed values as the norm kernel rounds them. Or the
op's own kernel runs first and writes the rows' absmax (Fp8SplitGemv's rows "amax"), which on
the down projection measured faster (bench/results/h200.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged.kernels import pdl
from paged.kernels.compile_ahead import launcher
from paged.kernels.e4m3 import quantize_e4m3, token_scale
from paged.kernels.fused import fused_add_rms_norm, rms_scaled, silu_and_mul_absmax, silu_mul
from paged.kernels.gemv import DOT_WIDTH

Config = tuple[int, int, int, int, int]  # (BLOCK_N, BLOCK_K, SPLIT, warps, stages)
AMAX_ELEMENTS = 4096  # activations read a step for the rows' absmax (32 a thread at 4 warps)


@triton.jit
def _fp8_gemv_split_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, res_ptr, g_ptr,
    res_out_ptr, M, N, K, k_per_split, stride_xm, stride_wn, stride_om, eps,
    xs_cols, HAS_BIAS: tl.constexpr, NORM: tl.constexpr, SILU_MUL: tl.constexpr,
    X_AMAX: tl.constexpr, XS_PAD: tl.constexpr, ROWS: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, AMAX_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """BLOCK_N outputs of all M rows over one of SPLIT slices of K. ROWS (M rounded up to a
    power of 2) rows are loaded, each filling 16 / ROWS adjacent columns of the dot, as in
    _fp8_gemv_dot_kernel. The rows' absmax is read AMAX_K columns a step (a few wide loads,
    not K / BLOCK_K dependent ones), or under X_AMAX is the max of xs_cols partial maxima a
    row at xs_ptr (fused.fused_add_rms_norm's or silu_and_mul_absmax's). The first weight
    tile is loaded
    before the PDL wait (`pdl`): no kernel writes the weight."""
    REP: tl.constexpr = 16 // ROWS
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    cols64 = cols.to(tl.int64)
    w_rows = w_ptr + cols64[:, None] * stride_wn
    k_start = pid_s * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    ks = k_start + tl.arange(0, BLOCK_K)
    w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & (ks < k_end)[None, :], other=0.0)
    pdl.enter(PDL)
    r = tl.arange(0, ROWS)
    r_ok = r < M
    x_rows = x_ptr + r.to(tl.int64)[:, None] * stride_xm
    res_rows = r.to(tl.int64)[:, None] * K  # offsets of the residual rows (contiguous)
    rstd = tl.zeros((ROWS,), dtype=tl.float32)
    if NORM:  # the rows' rsqrt(mean((x + residual)^2) + eps); one program writes x + residual
        sq = tl.zeros((ROWS, AMAX_K), dtype=tl.float32)
        first = (pid_n == 0) & (pid_s == 0)
        for k0 in range(0, K, AMAX_K):
            kk = k0 + tl.arange(0, AMAX_K)
            ok = r_ok[:, None] & (kk < K)[None, :]
            s = _residual_sum(x_rows, res_ptr + res_rows, kk, ok)
            if first:
                tl.store(res_out_ptr + res_rows + kk[None, :], s, mask=ok)
            sq += s.to(tl.float32) * s.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(sq, axis=1) / K + eps)
    if X_AMAX:
        p = tl.arange(0, XS_PAD)
        parts = tl.load(xs_ptr + r[:, None] * xs_cols + p[None, :],
                        mask=r_ok[:, None] & (p < xs_cols)[None, :], other=0.0)  # fmt: skip
        x_scale = token_scale(tl.max(parts, axis=1))
    else:
        amax = tl.zeros((ROWS, AMAX_K), dtype=tl.float32)
        for k0 in range(0, K, AMAX_K):  # the whole rows: the token's scale
            kk = k0 + tl.arange(0, AMAX_K)
            a = _input(x_rows, res_ptr + res_rows, g_ptr, kk, r_ok[:, None] & (kk < K)[None, :],
                       K, rstd, NORM, SILU_MUL)  # fmt: skip
            amax = tl.maximum(amax, tl.abs(a))
        x_scale = token_scale(tl.max(amax, axis=1))  # [ROWS]
    acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    acc = _dot_step(x_rows, res_ptr + res_rows, g_ptr, r_ok, ks, k_end, K, rstd, x_scale, w,
                    acc, NORM, SILU_MUL, ROWS, REP, BLOCK_K)  # fmt: skip
    for k0 in range(k_start + BLOCK_K, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & (ks < k_end)[None, :],
                    other=0.0)  # fmt: skip
        acc = _dot_step(x_rows, res_ptr + res_rows, g_ptr, r_ok, ks, k_end, K, rstd, x_scale,
                        w, acc, NORM, SILU_MUL, ROWS, REP, BLOCK_K)  # fmt: skip
    c = tl.arange(0, 16)
    row = c // REP
    keep = col_ok[:, None] & ((row < M) & (c % REP == 0))[None, :]  # one column a row
    if SPLIT == 1:
        _finish(acc, x_scale, ws_ptr, bias_ptr, out_ptr, cols64, col_ok, row, keep, stride_om,
                HAS_BIAS, ROWS, REP)  # fmt: skip
    else:
        part = part_ptr + row.to(tl.int64)[None, :] * SPLIT * N + cols64[:, None]
        tl.store(part + pid_s * N, acc, mask=keep)
        tl.debug_barrier()  # every thread's partial stored before the ticket (release)
        if tl.atomic_add(count_ptr + pid_n, 1) == SPLIT - 1:  # acq_rel: the partials visible
            total = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
            for s in tl.static_range(SPLIT):
                total += tl.load(part + s * N, mask=keep, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(count_ptr + pid_n, 0)
            _finish(total, x_scale, ws_ptr, bias_ptr, out_ptr, cols64, col_ok, row, keep,
                    stride_om, HAS_BIAS, ROWS, REP)  # fmt: skip


@triton.jit
def _residual_sum(x_rows, res_rows, kk, ok):
    """x + residual at columns kk, rounded to x's dtype as the residual add rounds."""
    a = tl.load(x_rows + kk[None, :], mask=ok, other=0.0)
    r = tl.load(res_rows + kk[None, :], mask=ok, other=0.0)
    return (a.to(tl.float32) + r.to(tl.float32)).to(a.dtype)


@triton.jit
def _input(x_rows, res_rows, g_ptr, kk, ok, K, rstd, NORM: tl.constexpr,
           SILU_MUL: tl.constexpr):  # fmt: skip
    """The linear's input at columns kk, in float32: x itself; under SILU_MUL silu(gate) * up
    (x's halves) rounded as silu_and_mul rounds; under NORM g * (s * rstd), s = x + residual,
    rounded as the RMSNorm kernel rounds (rstd: the rows' [ROWS])."""
    if NORM:
        s = _residual_sum(x_rows, res_rows, kk, ok)
        g = tl.load(g_ptr + kk, mask=kk < K, other=0.0)
        a = rms_scaled(s, rstd[:, None], g[None, :], s.dtype).to(s.dtype)
    else:
        a = tl.load(x_rows + kk[None, :], mask=ok, other=0.0)
        if SILU_MUL:
            up = tl.load(x_rows + K + kk[None, :], mask=ok, other=0.0)
            a = silu_mul(a, up).to(up.dtype)
    return a.to(tl.float32)


@triton.jit
def _dot_step(x_rows, res_rows, g_ptr, r_ok, ks, k_end, K, rstd, x_scale, w, acc,
              NORM: tl.constexpr, SILU_MUL: tl.constexpr, ROWS: tl.constexpr,
              REP: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """acc + the weight tile `w` (columns `ks`) times the rows' quantized input at `ks`."""
    a = _input(x_rows, res_rows, g_ptr, ks, r_ok[:, None] & (ks < k_end)[None, :], K, rstd,
               NORM, SILU_MUL)  # fmt: skip
    q = quantize_e4m3(a, x_scale[:, None])
    q16 = tl.reshape(tl.broadcast_to(q[:, None, :], (ROWS, REP, BLOCK_K)), (16, BLOCK_K))
    return acc + tl.dot(w, tl.trans(q16.to(w.dtype)), out_dtype=tl.float32)


@triton.jit
def _finish(acc, x_scale, ws_ptr, bias_ptr, out_ptr, cols64, col_ok, row, keep, stride_om,
            HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, REP: tl.constexpr):  # fmt: skip
    """The summed block times the weight's and the rows' scales, plus the bias, stored."""
    xs16 = tl.reshape(tl.broadcast_to(x_scale[:, None], (ROWS, REP)), (16,))
    acc = acc * tl.load(ws_ptr + cols64, mask=col_ok, other=0.0)[:, None] * xs16[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols64, mask=col_ok, other=0.0).to(tl.float32)[:, None]
    ptrs = out_ptr + row.to(tl.int64)[None, :] * stride_om + cols64[:, None]
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=keep)


def split_counters(n: int, config: Config) -> int:
    """How many int32 counters `fp8_gemv_split` needs for a weight of n rows under `config`."""
    return triton.cdiv(n, config[0])


def fp8_gemv_split(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    config: Config,
    counters: torch.Tensor,
    norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    silu_mul: bool = False,
    x_amax: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The fp8 linear (per-row weight scales [N, 1], x [M, K] quantized per token, M <= 16)
    with K split over `config`'s (BLOCK_N, BLOCK_K, SPLIT, warps, stages). `counters`: int32
    zeros, at least split_counters(); every launch leaves them zero again (so they can be
    shared by the linears of a stream, and captured in a CUDA graph).

    `norm` (residual [M, K], g [K], eps): the input is rms_norm(x + residual) * g instead of x;
    returns (out, x + residual), the new residual in a new tensor. `silu_mul`: x is [M, 2K], a
    gated MLP's gate/up output, and the input is silu_and_mul(x) (not with `norm`). `x_amax`
    [M, P] (neither): the rows' absmax is the max of these (the op's kernel wrote them), not
    read from x."""
    m, k = x.shape
    n = weight.shape[0]
    assert scale.shape[1] == 1 and m <= DOT_WIDTH and x.stride(1) == 1
    if silu_mul:
        assert norm is None and k == 2 * weight.shape[1]
        k //= 2
    if x_amax is not None:
        assert norm is None and not silu_mul and x_amax.shape[0] == m and x_amax.stride(1) == 1
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(x) if norm is not None else out
    if m == 0:
        return out if norm is None else (out, res_out)
    res, g, eps = norm if norm is not None else (out, out, 0.0)
    if norm is not None:
        assert res.shape == x.shape and res.is_contiguous() and g.shape == (k,)
    block_n, block_k, split, warps, stages = config
    per = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    part = torch.empty(m, split, n, dtype=torch.float32, device=x.device) if split > 1 else out
    assert split == 1 or counters.numel() >= split_counters(n, config)
    rows = triton.next_power_of_2(m)
    amax_k = min(AMAX_ELEMENTS // rows, max(16, triton.next_power_of_2(k)))
    launcher(_fp8_gemv_split_kernel, (triton.cdiv(n, block_n), split))(
        x, x_amax if x_amax is not None else scale, weight, scale,
        bias if bias is not None else out,
        out, part, counters, res, g, res_out, m, n, k, per, x.stride(0), weight.stride(0),
        out.stride(0), eps, x_amax.shape[1] if x_amax is not None else 1,
        HAS_BIAS=bias is not None, NORM=norm is not None, SILU_MUL=silu_mul,
        X_AMAX=x_amax is not None,
        XS_PAD=triton.next_power_of_2(x_amax.shape[1]) if x_amax is not None else 1, ROWS=rows,
        SPLIT=split, BLOCK_N=block_n, BLOCK_K=block_k, AMAX_K=amax_k, num_warps=warps,
        num_stages=stages, **pdl.launch(),
    )  # fmt: skip
    return out if norm is None else (out, res_out)


class Fp8SplitGemv:
    """A per-channel fp8 QuantLinear's forward on `fp8_gemv_split` for inputs of up to
    `max_rows` rows (a measured choice: the CUDA plugin's fp8_select installs it per weight
    shape), the layer's own forward otherwise. With `norm` or `silu_mul` (inputs it `takes`)
    it also runs the residual add and RMSNorm, or SiLU-and-mul, before the projection, as
    gemv.OneRowGemv does for 16-bit weights. `rows` says who computes that op and the rows'
    absmax (the per-token scale): "fold", every program of the GEMV, over the whole row;
    "amax", the op's kernel, once, before the GEMV (fused.py: fused_add_rms_norm's `amax`,
    silu_and_mul_absmax; the norm's inputs are then
    updated in place, as fused_add_rms_norm does)."""

    ROWS = ("fold", "amax")

    def __init__(self, mod: torch.nn.Module, config: Config, counters: torch.Tensor,
                 max_rows: int = 4, rows: str = "fold") -> None:  # fmt: skip
        assert rows in self.ROWS
        self.mod, self.config, self.counters, self.max_rows = mod, config, counters, max_rows
        self.rows = rows

    def takes(self, x: torch.Tensor) -> bool:
        """Whether x (2-D) runs on the split GEMV, and so may have the op before it folded in."""
        return x.dim() == 2 and x.shape[0] <= self.max_rows and x.stride(1) == 1

    folds = takes  # the op before is folded in wherever the split GEMV runs

    def __call__(self, x: torch.Tensor, norm=None, silu_mul: bool = False):
        if norm is not None or silu_mul:
            assert self.takes(x), "the fused input op needs an input of few rows"
            return self._gemv(x, norm, silu_mul)
        k = x.shape[-1]
        if x.numel() > self.max_rows * k:
            return type(self.mod).forward(self.mod, x)
        x2 = x.reshape(-1, k)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        return self._gemv(x2, None, False).view(*x.shape[:-1], self.mod.weight.shape[0])

    def _gemv(self, x: torch.Tensor, norm, silu_mul: bool):
        w, s, b, config, counters = (self.mod.weight, self.mod.weight_scale, self.mod.bias,
                                     self.config, self.counters)  # fmt: skip
        if self.rows == "amax" and norm is not None:
            amax = torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device)
            x, res = fused_add_rms_norm(x, norm[0], norm[1], norm[2], amax)
            return fp8_gemv_split(x, w, s, b, config, counters, x_amax=amax), res
        if self.rows == "amax" and silu_mul:
            act, amax = silu_and_mul_absmax(x)
            return fp8_gemv_split(act, w, s, b, config, counters, x_amax=amax)
        return fp8_gemv_split(x, w, s, b, config, counters, norm, silu_mul)
