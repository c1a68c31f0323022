"""Structured outputs' token mask applied to the logits in one pass: -inf is written where a
token's bit is clear, nothing else is read or written (the torch default in paged.model.ops
expands the bitmask through a table: a gather as large as the logits)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # token ids per program


@triton.jit
def _apply_bitmask_kernel(logits_ptr, mask_ptr, rows_ptr, stride_l, stride_m, n,
                          HAS_ROWS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    k = tl.program_id(0)
    ids = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = ids < n
    row = k.to(tl.int64)
    if HAS_ROWS:
        row = tl.load(rows_ptr + k).to(tl.int64)
    words = tl.load(mask_ptr + k.to(tl.int64) * stride_m + ids // 32, mask=ok, other=-1)
    clear = ((words >> (ids % 32)) & 1) == 0
    tl.store(logits_ptr + row * stride_l + ids, float("-inf"), mask=ok & clear)


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None
) -> None:
    """In place, as paged.model.ops.apply_token_bitmask: rows `rows` [k] of `logits` (None:
    all k rows, in order) get -inf where their bit in `bitmask` (int32 [k, words]) is clear;
    ids past the bitmask stay as they are."""
    k, words = bitmask.shape
    if k == 0:
        return
    assert logits.stride(-1) == 1 and bitmask.stride(-1) == 1
    n = min(logits.shape[-1], words * 32)
    grid = (k, triton.cdiv(n, BLOCK))
    _apply_bitmask_kernel[grid](
        logits, bitmask, rows if rows is not None else bitmask, logits.stride(0),
        bitmask.stride(0), n, HAS_ROWS=rows is not None, BLOCK=BLOCK, num_warps=8,
    )  # fmt: skip
