"""Batched LoRA for a step that mixes adapters (punica / SGMV style): the tokens of each
device slot are listed together (`LoRABatch`: token indices grouped by slot, and where each
slot's run starts), and one kernel launch multiplies every slot's rows by that slot's matrix.

    shrink:  xa[t] = x[t] @ A[slot(t)]^T                 A [slots, N, K]   (N: slices x rank)
    expand:  y[t, slice j] += xa[t, jR:(j+1)R] @ B_j[slot(t)]^T
             B [slots, out, R]: the slices' rows stacked (scale folded in), one launch for all

A program of `_lora_gemm` takes BLOCK_M rows of one slot's run and BLOCK_N output columns:
program m along M finds its slot among the runs' block offsets (paged.lora.batch). The grid
is fixed by the token count and the slot count (tokens / BLOCK_M + slots along M), never by
the step's lists, so nothing waits for the device and CUDA graphs can capture it: programs
past the last run exit at once. Tokens without an adapter are in no run and are left alone.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _lora_gemm(
    x_ptr,  # [T, >= x_col + K]
    w_ptr,  # [slots, N, K]
    y_ptr,  # [T, N] (a column view of a wider output is fine: row stride)
    ids_ptr,  # [>= T] token indices, grouped by slot
    starts_ptr,  # [slots + 1] where each slot's run starts in ids
    blocks_ptr,  # [slots + 1] where each slot's BLOCK_M blocks start among all of them
    num_slots,
    N,
    K,
    x_col,
    s1,  # expand: where slices 1 and 2 start among the output columns (N: no such slice)
    s2,
    r_stride,  # expand: xa columns per slice (the rank R); slice j reads from x_col + j R
    stride_xm,
    stride_ws,
    stride_wn,
    stride_ym,
    ADD: tl.constexpr,
    SPLIT_K: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SLOTS_P2: tl.constexpr,  # a power of two > num_slots
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1) // SPLIT_K
    pid_k = tl.program_id(1) % SPLIT_K
    offs = tl.arange(0, SLOTS_P2)
    firsts = tl.load(blocks_ptr + offs, mask=offs <= num_slots, other=1 << 30)
    slot = tl.sum((firsts <= pid_m).to(tl.int32)) - 1  # the last slot starting at or before
    if slot >= num_slots:  # past the last block
        return
    lo = tl.load(starts_ptr + slot)
    hi = tl.load(starts_ptr + slot + 1)
    row0 = lo + (pid_m - tl.load(blocks_ptr + slot)) * BLOCK_M
    if row0 >= hi:
        return
    rows = row0 + tl.arange(0, BLOCK_M)
    valid = rows < hi
    tok = tl.load(ids_ptr + rows, mask=valid, other=0).to(tl.int64)
    col0 = pid_n * BLOCK_N
    cols = col0 + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    # the slice of this column block (slice boundaries are multiples of BLOCK_N)
    xc = x_col + ((col0 >= s1).to(tl.int32) + (col0 >= s2).to(tl.int32)) * r_stride
    w_base = w_ptr + slot.to(tl.int64) * stride_ws
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_len = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K  # this program's share of K
    for k0 in range(pid_k * k_len, tl.minimum(K, (pid_k + 1) * k_len), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(x_ptr + tok[:, None] * stride_xm + xc + ks[None, :],
                    mask=valid[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        w = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None],
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # fmt: skip
        if UPCAST:  # the CPU interpreter multiplies bf16 storage (uint16) as ints
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        else:  # expand: the float32 shrink output times the model-dtype B
            a = a.to(w.dtype)
        if IEEE:
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    out = y_ptr + tok[:, None] * stride_ym + cols[None, :]
    mask = valid[:, None] & col_ok[None, :]
    if SPLIT_K > 1:  # K split over programs: partial sums into a float32 output
        tl.atomic_add(out, acc, mask=mask)
        return
    if ADD:
        acc += tl.load(out, mask=mask, other=0.0).to(tl.float32)
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mask)


def _launch(
    x,
    w,
    y,
    meta,
    x_col: int,
    k: int,
    add: bool,
    split_k: int = 1,
    slices: tuple[int, int, int] | None = None,
    block_n: int | None = None,
) -> None:
    """slices: (s1, s2, R) of an expand over stacked slices (None: one slice)."""
    t = x.shape[0]
    slots, n = w.shape[0], w.shape[1]
    if t == 0 or n == 0:
        return
    assert x.stride(1) == 1 and w.stride(2) == 1 and y.stride(1) == 1
    s1, s2, r_stride = slices or (n, n, 0)
    block_m = 16 if t <= 512 else 64
    block_n = block_n or _block_n(n)
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    cpu = x.device.type == "cpu"  # the interpreter
    grid = (triton.cdiv(t, block_m) + slots, triton.cdiv(n, block_n) * split_k)
    _lora_gemm[grid](
        x, w, y, meta.token_ids, meta.starts, meta.blocks[block_m], slots, n, k, x_col,
        s1, s2, r_stride,
        x.stride(0), w.stride(0), w.stride(1), y.stride(0),
        ADD=add, SPLIT_K=split_k, IEEE=w.dtype == torch.float32 or cpu,
        UPCAST=cpu and (x.dtype != torch.float32 or w.dtype != torch.float32),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        SLOTS_P2=triton.next_power_of_2(slots + 1), num_warps=4,
    )  # fmt: skip


def lora_shrink(x: torch.Tensor, a: torch.Tensor, meta) -> torch.Tensor:
    """paged.model.ops.lora_shrink on the device: x [T, K], a [slots, N, K] -> [T, N] float32
    (rows of tokens without an adapter are zero). K (the hidden size) is split over programs
    that add their partial products (N is only slices x rank: without the split, a decode
    step would run a handful of programs down all of K)."""
    out = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    k = a.shape[2]
    _launch(x, a, out, meta, 0, k, add=False, split_k=max(1, min(32, k // 256)))
    return out


def _block_n(n: int) -> int:
    return min(128 if n >= 4096 else 64, max(16, triton.next_power_of_2(n)))


def lora_expand(y: torch.Tensor, xa: torch.Tensor, b: torch.Tensor, sizes: list[int],
                meta) -> None:  # fmt: skip
    """paged.model.ops.lora_expand on the device: for each slice j of `sizes` (rows of y's
    columns and of b), y[:, slice j] += xa[:, jR:(j+1)R] @ B[slot, slice j]^T in place;
    b [slots, sum(sizes), R]. One launch when the slice boundaries fall on column blocks
    (every Llama-shaped projection), else one per slice."""
    r = b.shape[2]
    bounds = [sum(sizes[: j + 1]) for j in range(len(sizes) - 1)]
    if len(sizes) <= 3:
        block = _block_n(b.shape[1])
        while block > 16 and any(x % block for x in bounds):
            block //= 2
        if not any(x % block for x in bounds):
            s1, s2 = (bounds + [b.shape[1]] * 2)[:2]
            _launch(xa, b, y, meta, 0, r, add=True, slices=(s1, s2, r), block_n=block)
            return
    off = 0
    for j, n in enumerate(sizes):
        _launch(xa, b[:, off : off + n], y[:, off : off + n], meta, j * r, r, add=True)
        off += n
