"""The int4 decode GEMV split over K: up to 4 rows times int4 weights (AWQ / GPTQ repacked, or
a GGUF's Q4_0 / Q4_1 blocks) or 8-bit ones (a GGUF's Q8_0 blocks), `int4_gemm.int4_linear`'s
arithmetic on a grid of (rows, output blocks, SPLIT slices of K).

The unsplit `_int4_gemv` gives each program 32 outputs over the whole of K, 16 code words a
column per step: for a 4096-wide projection that is 128 programs with 2 KB in flight each, far
too little to cover the memory's latency (177 GB/s measured on an H200). Here a program loads
a [BLOCK_N, BLOCK_K / 8] tile of code words at once (BLOCK_K / 4 with 8-bit codes; up to 256
contiguous bytes a column) over its slice of K, and the grid has SPLIT times more programs.

A tile is dequantized code by code: the j-th nibble of every word is the column 8 w + j (the
j-th byte: 4 w + j), so it multiplies the input's columns j, j + 8, ... (a strided load of the
row, which stays in the cache); no reshape of the tile. Weights are (code - zero) * scale
(+ min, GGUF Q4_1) rounded to the row's dtype, as the reference rounds them; products and
sums in float32. The codes become floats by bit operations, not int-to-float conversions
(which issue at an eighth of the FMA rate on Hopper and would bound the kernel). When BLOCK_K
is wider than a group (GGUF's groups of 32) each word reads its own group's scale.

Partial sums: as `gemv.gemv_split_k`, the last program of an output block (counted
atomically) adds the SPLIT float32 partials in slice order, adds the bias and stores the block,
then resets its counter, so one launch, graph-safe, the same sums whichever program is last.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged.kernels import pdl
from paged.kernels.gemv import _store_row
from paged.kernels.int4_gemm import GEMV_MAX_ROWS

Config = tuple[int, int, int, int]  # (BLOCK_N, BLOCK_K, SPLIT, warps)


@triton.jit
def _int4_gemv_split_kernel(
    x_ptr, codes_ptr, scales_ptr, zeros_ptr, mins_ptr, bias_ptr, out_ptr, part_ptr, count_ptr,
    N, KW, G, group_w, words_per_split, stride_c, stride_x, stride_o, HAS_BIAS: tl.constexpr,
    HAS_MIN: tl.constexpr, WORD_GROUPS: tl.constexpr, BITS: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr, WK: tl.constexpr, EVEN: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One input row's BLOCK_N outputs over one of SPLIT slices of the KW code words a weight
    row (K BITS / 32), WK words a step. The rows are the grid's fastest axis, so the programs
    of one weight tile run side by side and all but the first read it from the cache. Indices
    count words, so the compiler sees the rows' alignment (stride_c) and loads 16 bytes at a
    time. The first tile of code words is loaded before the PDL wait (`pdl`): no kernel writes
    the weights. EVEN: whole tiles everywhere (N, K and every slice), so no load is masked."""
    row = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    x_ptr += row * stride_x
    out_ptr += row * stride_o
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    cols64 = cols.to(tl.int64)
    w_start = pid_s * words_per_split
    w_end = tl.minimum(w_start + words_per_split, KW)
    words = _load_words(codes_ptr, cols64, col_ok, w_start, w_end, stride_c, WK, EVEN)
    pdl.enter(PDL)
    acc = tl.zeros((BLOCK_N, WK), dtype=tl.float32)
    acc = _step(x_ptr, words, scales_ptr, zeros_ptr, mins_ptr, cols64, col_ok, w_start, w_end,
                G, group_w, acc, out_ptr.dtype.element_ty, HAS_MIN, WORD_GROUPS, BITS, WK,
                EVEN)  # fmt: skip
    for w0 in range(w_start + WK, w_end, WK):
        words = _load_words(codes_ptr, cols64, col_ok, w0, w_end, stride_c, WK, EVEN)
        acc = _step(x_ptr, words, scales_ptr, zeros_ptr, mins_ptr, cols64, col_ok, w0, w_end,
                    G, group_w, acc, out_ptr.dtype.element_ty, HAS_MIN, WORD_GROUPS, BITS, WK,
                    EVEN)  # fmt: skip
    total = tl.sum(acc, axis=1)
    if SPLIT == 1:
        _store_row(total, bias_ptr, out_ptr, cols, col_ok, HAS_BIAS)
    else:
        part = part_ptr + row * SPLIT * N + cols64
        tl.store(part + pid_s * N, total, mask=col_ok)
        slot = row * tl.num_programs(1) + pid_n
        tl.debug_barrier()  # every thread's partial stored before the ticket (release)
        if tl.atomic_add(count_ptr + slot, 1) == SPLIT - 1:  # acq_rel: the partials visible
            total = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for s in tl.static_range(SPLIT):
                total += tl.load(part + s * N, mask=col_ok, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(count_ptr + slot, 0)
            _store_row(total, bias_ptr, out_ptr, cols, col_ok, HAS_BIAS)


@triton.jit
def _load_words(codes_ptr, cols64, col_ok, w0, w_end, stride_c, WK: tl.constexpr,
                EVEN: tl.constexpr):  # fmt: skip
    """The code words [BLOCK_N, WK] w0 .. w0 + WK (those before w_end) of the columns."""
    w_idx = w0 + tl.arange(0, WK)
    ptrs = codes_ptr + cols64[:, None] * stride_c + w_idx[None, :]
    return _load(ptrs, col_ok[:, None] & (w_idx < w_end)[None, :], 0, EVEN)


@triton.jit
def _load(ptrs, mask, other, EVEN: tl.constexpr):
    """A masked load, or (EVEN: every tile whole) a plain one."""
    if EVEN:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=mask, other=other)


@triton.jit
def _step(x_ptr, words, scales_ptr, zeros_ptr, mins_ptr, cols64, col_ok, w0, w_end, G, group_w,
          acc, dtype: tl.constexpr, HAS_MIN: tl.constexpr, WORD_GROUPS: tl.constexpr,
          BITS: tl.constexpr, WK: tl.constexpr, EVEN: tl.constexpr):  # fmt: skip
    """acc + the tile's weights times the row: code j of word w is column PER w + j."""
    w_idx = w0 + tl.arange(0, WK)
    w_ok = w_idx < w_end
    s, z, m = _group_params(scales_ptr, zeros_ptr, mins_ptr, cols64, col_ok, w_idx, w_ok, w0,
                            w_end, G, group_w, HAS_MIN, WORD_GROUPS, EVEN)  # fmt: skip
    PER: tl.constexpr = 32 // BITS  # codes a word
    high = words >> 16
    for j in tl.static_range(PER):
        w = _code_weights(words, high, j, s, z, m, dtype, HAS_MIN, BITS)
        x = _load(x_ptr + w_idx * PER + j, w_ok, 0.0, EVEN).to(tl.float32)
        acc += w.to(tl.float32) * x[None, :]
    return acc


@triton.jit
def _group_params(scales_ptr, zeros_ptr, mins_ptr, cols64, col_ok, w_idx, w_ok, w0, w_end, G,
                  group_w, HAS_MIN: tl.constexpr, WORD_GROUPS: tl.constexpr,
                  EVEN: tl.constexpr):  # fmt: skip
    """The scales, zeros (as floats) and mins of a tile of code words, [BLOCK_N, WK] where the
    tile spans groups (WORD_GROUPS: a group per word), else [BLOCK_N, 1]."""
    if WORD_GROUPS:
        at = cols64[:, None] * G + (w_idx // group_w)[None, :]
        ok = col_ok[:, None] & w_ok[None, :]
        s = _load(scales_ptr + at, ok, 0.0, EVEN)
        z = _load(zeros_ptr + at, ok, 0, EVEN)
        m = _load(mins_ptr + at, ok, 0.0, EVEN) if HAS_MIN else s
    else:  # the tile lies in one group (WK divides group_w)
        at = cols64 * G + w0 // group_w
        ok = col_ok & (cols64 * 0 + w0 < w_end)  # an empty slice (past the row) reads no group
        s = _load(scales_ptr + at, ok, 0.0, EVEN)[:, None]
        z = _load(zeros_ptr + at, ok, 0, EVEN)[:, None]
        m = _load(mins_ptr + at, ok, 0.0, EVEN)[:, None] if HAS_MIN else s
    return s, z.to(tl.float32), m


@triton.jit
def _code_weights(words, high, j: tl.constexpr, s, z, m, dtype: tl.constexpr,
                  HAS_MIN: tl.constexpr, BITS: tl.constexpr):  # fmt: skip
    """The weights of code j of each word (`high`: the words >> 16), rounded to `dtype`.

    A code becomes a float without an int-to-float conversion (a slow instruction) and without
    a shift: code j of the word's low half, masked in place, OR 0x4B000000 is the
    float 2^23 + code * 2^e (e = BITS j, at most 12, so exact), minus 2^23 + zero * 2^e is
    (code - zero) * 2^e exactly, and times scale * 2^-e (exact: a power of two) it is the
    reference's float32 (code - zero) * scale, the same rounding. The high half's codes take
    one shift per word. Then + min, rounded to `dtype`: the reference's bits."""
    HALF: tl.constexpr = 16 // BITS  # codes in a word's low 16 bits
    e: tl.constexpr = BITS * (j % HALF)
    half = words if j < HALF else high
    bits = (half & (((1 << BITS) - 1) << e)) | 0x4B000000  # the float 2^23 + code * 2^e
    zero, scale = 8388608.0 + z * (1 << e), s * (1.0 / (1 << e))  # per column and group
    w = (bits.to(tl.float32, bitcast=True) - zero) * scale
    if HAS_MIN:  # GGUF Q4_1: code * d + m, two roundings (no FMA contraction at launch)
        w += m
    return w.to(dtype)


MAX_ROWS = GEMV_MAX_ROWS  # input rows a launch takes: the unsplit GEMV's range


def split_counters(n: int, config: Config, rows: int = MAX_ROWS) -> int:
    """How many int32 counters `int4_gemv_split` needs for a weight of n rows under `config`,
    for inputs of up to `rows` rows."""
    return rows * triton.cdiv(n, config[0])


def int4_gemv_split(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_k: int,
    bias: torch.Tensor | None,
    mins: torch.Tensor | None,
    config: Config,
    counters: torch.Tensor,
    bits: int = 4,
) -> torch.Tensor:
    """The int4 linear of x [M, K], M <= MAX_ROWS (codes int32 [N, K/8], or [N, K/4] with `bits`
    8; scales / zeros / mins [N, K/group_k]) with K split over `config`'s (BLOCK_N, BLOCK_K,
    SPLIT, warps).
    `counters`: int32 zeros, at least split_counters(); every launch leaves them zero again
    (so the linears of a stream share them, and a CUDA graph can capture the launch)."""
    m, k = x.shape
    n, groups = scales.shape
    per_word = 32 // bits
    assert m <= MAX_ROWS and x.stride(1) == 1 and codes.shape[1] * per_word == k
    block_n, block_k, split, warps = config
    assert block_k >= 16 and block_k & (block_k - 1) == 0 and codes.stride(1) == 1
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    per = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    part = torch.empty(m, split, n, dtype=torch.float32, device=x.device) if split > 1 else out
    assert split == 1 or counters.numel() >= split_counters(n, config, m)
    _int4_gemv_split_kernel[(m, triton.cdiv(n, block_n), split)](
        x, codes, scales, zeros, mins if mins is not None else scales,
        bias if bias is not None else out, out, part, counters, n, k // per_word, groups,
        group_k // per_word, per // per_word, codes.stride(0), x.stride(0), out.stride(0),
        HAS_BIAS=bias is not None,
        HAS_MIN=mins is not None, WORD_GROUPS=block_k > group_k, BITS=bits, SPLIT=split,
        BLOCK_N=block_n, WK=block_k // per_word,
        EVEN=n % block_n == 0 and k % block_k == 0 and per * (split - 1) < k,
        num_warps=warps, enable_fp_fusion=mins is None, **pdl.launch(),
    )  # fmt: skip
    return out


def code_bits(mod: torch.nn.Module) -> int:
    """4 or 8: the bits of an int4-family QuantLinear's codes (int32 words [N, K bits / 32])."""
    return 32 * mod.codes.shape[1] // mod.in_features


class Int4SplitGemv:
    """An int4 QuantLinear's forward on `int4_gemv_split` for inputs of up to MAX_ROWS rows (a
    measured choice at one row: the CUDA plugin's int4_select installs it per weight shape),
    the layer's own forward otherwise."""

    def __init__(self, mod: torch.nn.Module, config: Config, counters: torch.Tensor) -> None:
        self.mod, self.config, self.counters = mod, config, counters

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        mod = self.mod
        k = x.shape[-1]
        if x.numel() > MAX_ROWS * k:
            return type(mod).forward(mod, x)
        x2 = x.reshape(-1, k)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        y = int4_gemv_split(x2, mod.codes, mod.scales, mod.zeros, mod.group_k, mod.bias,
                            getattr(mod, "mins", None), self.config, self.counters,
                            code_bits(mod))  # fmt: skip
        return y.view(*x.shape[:-1], y.shape[-1])
