"""The int4 GEMM split over K, on the tensor cores: rows (a decode batch, a prefill chunk)
times int4 weights (AWQ / GPTQ repacked, a GGUF's Q4_0 / Q4_1 blocks) or 8-bit ones (a GGUF's
Q8_0 blocks), `int4_gemm.int4_linear`'s arithmetic on a grid of (row blocks, output blocks,
SPLIT slices of K). One row (batch-1 decode) too: its tensor-core products cost less than the
per-weight multiply-adds of a GEMV on the vector units.

Each program loads a [BLOCK_N, WK] tile of code words and dequantizes it once, code by code
(`_code_weights`): the j-th code of every word is input column PER w + j, so code j's weights
[BLOCK_N, WK] meet the rows' columns j, j + PER, ... (the step's columns of the rows loaded
whole and split per code in registers; 8-bit codes of fewer than 5 rows gather each code's
columns with a strided load instead) in one tl.dot of depth WK: PER dots a step, no
reshape of the tile. The row blocks are the grid's fastest axis, so the programs that share a
weight tile run side by side and read it from the cache. Weights are rounded to the rows' dtype
as the reference rounds them; products and sums in float32, in the tensor cores' order.

Partial sums: the last program of a (row block, output block) (counted atomically) adds the
SPLIT float32 partials in slice order, adds the bias and stores the block, then resets its
counter: one launch, graph-safe, the same sums whichever program is last.

Measured on an H100 (Llama-3.1-8B's four projections, group 128; bench/quant_gpu.py): a
layer's int4 linears at one row in 116 us against 165 us on a split-K GEMV and 693 us on a GEMV
of 32 outputs a program; 126 us at 4 rows and 159 us at 16, where the whole weight
dequantized, then cuBLAS, took 394 us. On 2026-12-06 blocks of 32 and 64 rows (the rows'
columns loaded contiguously) took 5.27 and 6.40 ms a step at 32 and 64 rows, two blocks of 64
11.26 ms at 128, against 12.4-12.8 dequantized (GGUF's layouts: 5.8-13.4 against 16.2-17.2),
so int4_linear dequantizes from 129 rows (at 256: 17.6 against 13.7).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged.kernels import pdl
from paged.kernels.compile_ahead import launcher

Config = tuple[int, int, int, int, int]  # (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT, warps)
PROGRAMS = 768  # default_config's target grid
COUNTER_SLOTS = 1 << 16  # tickets of a device's shared counters (int32)
# From this many input rows (by code bits) the row blocks load a step's columns of the rows
# contiguously and split them per code in registers; fewer gather each code's columns. On an
# H100 (2026-12-06, Llama-3.1-8B's layer x 32, ms a step, contiguous / gathered): 4-bit codes
# 4.01 / 4.18 at one row and 3.97 / 5.75 at 16 (GGUF Q4_1: 4.92 / 5.24, 4.74 / 6.55); 8-bit
# (GGUF Q8_0) 5.42 / 5.35 at one row, 5.37 / 7.09 at 16.
CONTIGUOUS_X_MIN_ROWS = {4: 1, 8: 5}
_counters: dict[torch.device, torch.Tensor] = {}


@triton.jit
def _int4_gemm_split_kernel(
    x_ptr, codes_ptr, scales_ptr, zeros_ptr, mins_ptr, bias_ptr, out_ptr, part_ptr, count_ptr,
    M, N, KW, G, words_per_split, stride_c, stride_x, stride_o, GROUP_W: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_MIN: tl.constexpr, WORD_GROUPS: tl.constexpr,
    BITS: tl.constexpr, SPLIT: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, WK: tl.constexpr, EVEN: tl.constexpr, CONTIGUOUS_X: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """BLOCK_M rows' BLOCK_N outputs over one of SPLIT slices of the KW code words a weight row,
    WK words a step. EVEN: whole weight tiles everywhere (N, K and every slice): the weights'
    loads are unmasked (the rows' never are)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    rows64 = rows.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    cols64 = cols.to(tl.int64)
    w_start = pid_s * words_per_split
    w_end = tl.minimum(w_start + words_per_split, KW)
    words = _load_words(codes_ptr, cols64, col_ok, w_start, w_end, stride_c, WK, EVEN)
    pdl.enter(PDL)  # the weights are nobody's output: their first tile loads before the wait
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = _mma_step(x_ptr, rows64, row_ok, stride_x, words, scales_ptr, zeros_ptr, mins_ptr,
                    cols64, col_ok, w_start, w_end, G, GROUP_W, acc, out_ptr.dtype.element_ty,
                    HAS_MIN, WORD_GROUPS, BITS, WK, EVEN, UPCAST, CONTIGUOUS_X)  # fmt: skip
    for w0 in range(w_start + WK, w_end, WK):
        words = _load_words(codes_ptr, cols64, col_ok, w0, w_end, stride_c, WK, EVEN)
        acc = _mma_step(x_ptr, rows64, row_ok, stride_x, words, scales_ptr, zeros_ptr,
                        mins_ptr, cols64, col_ok, w0, w_end, G, GROUP_W, acc,
                        out_ptr.dtype.element_ty, HAS_MIN, WORD_GROUPS, BITS, WK, EVEN,
                        UPCAST, CONTIGUOUS_X)  # fmt: skip
    mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT == 1:
        _store_block(acc, bias_ptr, out_ptr, rows64, cols64, col_ok, mask, stride_o, HAS_BIAS)
    else:
        part = part_ptr + rows64[:, None] * N + cols64[None, :]  # partials [SPLIT, M, N]
        plane = (tl.zeros((), tl.int64) + M) * N
        tl.store(part + pid_s * plane, acc, mask=mask)
        slot = pid_m * tl.num_programs(1) + pid_n
        tl.debug_barrier()  # every thread's partial stored before the ticket (release)
        if tl.atomic_add(count_ptr + slot, 1) == SPLIT - 1:  # acq_rel: the partials visible
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in tl.static_range(SPLIT):
                total += tl.load(part + s * plane, mask=mask, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(count_ptr + slot, 0)
            _store_block(total, bias_ptr, out_ptr, rows64, cols64, col_ok, mask, stride_o,
                         HAS_BIAS)  # fmt: skip


@triton.jit
def _mma_step(x_ptr, rows64, row_ok, stride_x, words, scales_ptr, zeros_ptr, mins_ptr, cols64,
              col_ok, w0, w_end, G, GROUP_W: tl.constexpr, acc, dtype: tl.constexpr,
              HAS_MIN: tl.constexpr, WORD_GROUPS: tl.constexpr, BITS: tl.constexpr,
              WK: tl.constexpr, EVEN: tl.constexpr, UPCAST: tl.constexpr,
              CONTIGUOUS_X: tl.constexpr):  # fmt: skip
    """acc [BLOCK_M, BLOCK_N] + the rows times the tile's weights: code j of word w is input
    column PER w + j, so code j's weights [BLOCK_N, WK] meet columns j, j + PER, ..."""
    w_idx = w0 + tl.arange(0, WK)
    w_ok = w_idx < w_end
    s, z, m = _group_params(scales_ptr, zeros_ptr, mins_ptr, cols64, col_ok, w_idx, w_ok, w0,
                            w_end, G, GROUP_W, HAS_MIN, WORD_GROUPS, WK, EVEN)  # fmt: skip
    PER: tl.constexpr = 32 // BITS
    high = words >> 16
    if CONTIGUOUS_X:
        acc = _dots_of_contiguous_rows(x_ptr, rows64, row_ok, stride_x, words, high, s, z, m,
                                       w0, w_end, acc, dtype, HAS_MIN, BITS, WK, UPCAST)
    else:
        x_rows = x_ptr + rows64[:, None] * stride_x
        x_mask = row_ok[:, None] & w_ok[None, :]
        for j in tl.static_range(PER):  # code j's strided columns gathered from the rows
            x = tl.load(x_rows + (w_idx * PER + j)[None, :], mask=x_mask, other=0.0)
            acc = _code_dot(acc, x, words, high, j, s, z, m, dtype, HAS_MIN, BITS, UPCAST)
    return acc


@triton.jit
def _dots_of_contiguous_rows(x_ptr, rows64, row_ok, stride_x, words, high, s, z, m, w0, w_end,
                             acc, dtype: tl.constexpr, HAS_MIN: tl.constexpr,
                             BITS: tl.constexpr, WK: tl.constexpr,
                             UPCAST: tl.constexpr):  # fmt: skip
    """_mma_step's dots with the rows' columns of the step loaded contiguously (wide loads, where
    per-code gathers issue a load per element) and split per code in registers: column PER w + j
    goes to code j by the bits of j."""
    PER: tl.constexpr = 32 // BITS
    cols = w0 * PER + tl.arange(0, WK * PER)
    x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :],
                mask=row_ok[:, None] & (cols < w_end * PER)[None, :], other=0.0)  # fmt: skip
    x = tl.reshape(x, (x.shape[0], WK, 2, 2, 2) if PER == 8 else (x.shape[0], WK, 2, 2))
    even, odd = tl.split(x)  # j's lowest bit
    e0, e1 = tl.split(even)
    o0, o1 = tl.split(odd)
    if PER == 8:
        x0, x4 = tl.split(e0)
        x2, x6 = tl.split(e1)
        x1, x5 = tl.split(o0)
        x3, x7 = tl.split(o1)
        acc = _code_dot(acc, x0, words, high, 0, s, z, m, dtype, HAS_MIN, BITS, UPCAST)
        acc = _code_dot(acc, x1, words, high, 1, s, z, m, dtype, HAS_MIN, BITS, UPCAST)
        acc = _code_dot(acc, x2, words, high, 2, s, z, m, dtype, HAS_MIN, BITS, UPCAST)
        acc = _code_dot(acc, x3, words, high, 3, s, z, m, dtype, HAS_MIN, BITS, UPCAST)
        acc = _code_dot(acc, x4, words, high, 4, s, z, m, dtype, HAS_MIN, BITS, UPCAST)
        acc = _code_dot(acc, x5, words, high, 5, s, z, m, dtype, HAS_MIN, BITS, UPCAST)
        acc = _code_dot(acc, x6, words, high, 6, s, z, m, dtype, HAS_MIN, BITS, UPCAST)
        acc = _code_dot(acc, x7, words, high, 7, s, z, m, dtype, HAS_MIN, BITS, UPCAST)
    else:  # 8-bit codes, 4 a word: j = 2 j1 + j0
        acc = _code_dot(acc, e0, words, high, 0, s, z, m, dtype, HAS_MIN, BITS, UPCAST)
        acc = _code_dot(acc, o0, words, high, 1, s, z, m, dtype, HAS_MIN, BITS, UPCAST)
        acc = _code_dot(acc, e1, words, high, 2, s, z, m, dtype, HAS_MIN, BITS, UPCAST)
        acc = _code_dot(acc, o1, words, high, 3, s, z, m, dtype, HAS_MIN, BITS, UPCAST)
    return acc


@triton.jit
def _code_dot(acc, x, words, high, j: tl.constexpr, s, z, m, dtype: tl.constexpr,
              HAS_MIN: tl.constexpr, BITS: tl.constexpr, UPCAST: tl.constexpr):  # fmt: skip
    """acc + the rows' columns of code j [BLOCK_M, WK] times code j's weights."""
    w = tl.trans(_code_weights(words, high, j, s, z, m, dtype, HAS_MIN, BITS))
    if UPCAST:  # float32, or the CPU interpreter (it multiplies bf16 storage as ints)
        return acc + tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    return acc + tl.dot(x.to(dtype), w)


@triton.jit
def _store_block(acc, bias_ptr, out_ptr, rows64, cols64, col_ok, mask, stride_o,
                 HAS_BIAS: tl.constexpr):  # fmt: skip
    """acc (+ bias) into the output block, in the output's dtype."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols64, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows64[:, None] * stride_o + cols64[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask)  # fmt: skip


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
def _group_params(scales_ptr, zeros_ptr, mins_ptr, cols64, col_ok, w_idx, w_ok, w0, w_end, G,
                  GROUP_W: tl.constexpr, HAS_MIN: tl.constexpr, WORD_GROUPS: tl.constexpr,
                  WK: tl.constexpr, EVEN: tl.constexpr):  # fmt: skip
    """The scales, zeros (as floats) and mins of a tile of code words (GROUP_W words a group),
    [BLOCK_N, WK] where the tile spans groups (WORD_GROUPS: each of its WK / GROUP_W groups
    loaded once, then repeated over its words in registers), else [BLOCK_N, 1]."""
    if WORD_GROUPS:
        GS: tl.constexpr = WK // GROUP_W  # groups a step (a step starts on a group)
        gi = w0 // GROUP_W + tl.arange(0, GS)
        at = cols64[:, None] * G + gi[None, :]
        ok = col_ok[:, None] & (gi * GROUP_W < w_end)[None, :]
        s = _per_word(_load(scales_ptr + at, ok, 0.0, EVEN), GS, GROUP_W)
        z = _per_word(_load(zeros_ptr + at, ok, 0, EVEN), GS, GROUP_W)
        m = _per_word(_load(mins_ptr + at, ok, 0.0, EVEN), GS, GROUP_W) if HAS_MIN else s
    else:  # the tile lies in one group (WK divides GROUP_W)
        at = cols64 * G + w0 // GROUP_W
        ok = col_ok & (cols64 * 0 + w0 < w_end)  # an empty slice (past the row) reads no group
        s = _load(scales_ptr + at, ok, 0.0, EVEN)[:, None]
        z = _load(zeros_ptr + at, ok, 0, EVEN)[:, None]
        m = _load(mins_ptr + at, ok, 0.0, EVEN)[:, None] if HAS_MIN else s
    return s, z.to(tl.float32), m


@triton.jit
def _per_word(v, GS: tl.constexpr, GROUP_W: tl.constexpr):
    """[BLOCK_N, GS] per group -> [BLOCK_N, GS * GROUP_W] per word."""
    rep = tl.broadcast_to(v[:, :, None], (v.shape[0], GS, GROUP_W))
    return tl.reshape(rep, (v.shape[0], GS * GROUP_W))


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


def default_config(m: int, n: int, k: int, bits: int) -> Config:
    """A config for m rows: a K step of 16 code words, K split up to 8 ways (each slice at least
    four steps). Up to 4 rows (decode): one block of 16 rows, 64 outputs a program, K split until
    the grid has PROGRAMS programs; 5-16 rows: 128 outputs, K split 8 ways. More rows, one block
    of 32 rows and 128 outputs up to 32 rows, of 64 and 64 outputs beyond: K split 4 ways, or
    (a grid of 128 blocks or more already) not at all up to 32 rows and 2 ways beyond. The H100
    sweeps (bench/results/quant-gpu.md, Llama-3.1-8B's four projections): at 16 rows (16, 128,
    128, 8) was the fastest for each, at one row 64 outputs split 4 to 8 ways for three of them,
    and at 32 and 64 rows these configs for all four (5.21 and 6.25 ms a step, against 6.74 and
    12.46 on blocks of 16 rows)."""
    block_k = 16 * 32 // bits
    if m > 16:
        block_m, block_n = (32, 128) if m <= 32 else (64, 64)
        tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
        split = 4 if tiles < 128 else (1 if m <= 32 else 2)
    else:
        block_m, block_n = 16, 64 if m <= 4 else 128
        tiles = triton.cdiv(n, block_n)
        split = 1
        while split < 8 and (m > 4 or tiles * split < PROGRAMS):
            split *= 2
    while split > 1 and (k // split < 4 * block_k or tiles > COUNTER_SLOTS):
        split //= 2
    return block_m, block_n, block_k, split, 4


def counters_for(device: torch.device) -> torch.Tensor:
    """The device's int32 ticket counters (zero between launches), made once."""
    counters = _counters.get(device)
    if counters is None:
        counters = _counters[device] = torch.zeros(COUNTER_SLOTS, dtype=torch.int32,
                                                   device=device)  # fmt: skip
    return counters


def int4_gemm_split(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_k: int,
    bias: torch.Tensor | None,
    mins: torch.Tensor | None,
    bits: int = 4,
    config: Config | None = None,
) -> torch.Tensor:
    """The int4 linear (`bits` 8: the 8-bit one) of x [M, K] (codes int32 [N, K / 8], or
    [N, K / 4]; scales / zeros / mins [N, K / group_k]) under `config` (default_config's if
    None)."""
    m, k = x.shape
    n, groups = scales.shape
    per_word = 32 // bits
    assert x.stride(1) == 1 and codes.stride(1) == 1 and codes.shape[1] * per_word == k
    block_m, block_n, block_k, split, warps = config or default_config(m, n, k, bits)
    assert block_k // per_word >= 16 and block_k & (block_k - 1) == 0
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    tiles_m = triton.cdiv(m, block_m)
    per = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    if split > 1:
        assert tiles_m * triton.cdiv(n, block_n) <= COUNTER_SLOTS
        part = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
        counters = counters_for(x.device)
    else:
        part = counters = out
    upcast = x.dtype == torch.float32 or x.device.type == "cpu"
    launcher(_int4_gemm_split_kernel, (tiles_m, triton.cdiv(n, block_n), split))(
        x, codes, scales, zeros, mins if mins is not None else scales,
        bias if bias is not None else out, out, part, counters, m, n, k // per_word, groups,
        per // per_word, codes.stride(0), x.stride(0), out.stride(0),
        GROUP_W=group_k // per_word, HAS_BIAS=bias is not None, HAS_MIN=mins is not None,
        WORD_GROUPS=block_k > group_k, BITS=bits, SPLIT=split, UPCAST=upcast, BLOCK_M=block_m,
        BLOCK_N=block_n, WK=block_k // per_word,
        EVEN=n % block_n == 0 and k % block_k == 0 and per * (split - 1) < k,
        CONTIGUOUS_X=m >= CONTIGUOUS_X_MIN_ROWS[bits], num_warps=warps,
        enable_fp_fusion=mins is None, **pdl.launch(),
    )  # fmt: skip
    return out


def code_bits(mod: torch.nn.Module) -> int:
    """4 or 8: the bits of an int4-family QuantLinear's codes (int32 words [N, K bits / 32])."""
    return 32 * mod.codes.shape[1] // mod.in_features
