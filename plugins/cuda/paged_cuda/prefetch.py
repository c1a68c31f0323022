"""L2 prefetch of the next weight while a kernel that reads little runs (`--cuda-l2-prefetch`).

At a few rows a decode step reads every weight once, but its attention kernel, between the
QKV and the o_proj GEMVs, reads only the short KV cache: HBM idles for its microseconds. This
kernel, launched before the attention, waits for the QKV GEMV (PDL), lets the attention start,
and issues Hopper's bulk L2 prefetch (`cp.async.bulk.prefetch.L2`, compute capability 9.0)
over o_proj's weight: the copy engine pulls it while the attention runs, and the GEMV then
finds part of it in L2. The prefetch reads and writes nothing a kernel sees, so it changes no
result. Measured by bench/l2_prefetch_gpu.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged.kernels import pdl

PIECE = 16384  # bytes one lane asks for
LANES = 128
MAX_ROWS = 16  # larger steps' attention reads the cache at bandwidth: no idle HBM to use


@triton.jit
def bulk_prefetch(base, offs, nbytes, PIECE: tl.constexpr):
    """Ask for bytes [offs, offs + PIECE) of `base` (an int8 pointer) in L2, within nbytes
    (lanes past the end ask for nothing; sizes rounded down to the 16 bytes the op needs)."""
    size = (tl.minimum(tl.maximum(nbytes - offs, 0), PIECE) // 16 * 16).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.u32 p, $2, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [base + offs, size], dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def _prefetch_kernel(w_ptr, nbytes, PIECE: tl.constexpr, LANES: tl.constexpr,
                     PDL: tl.constexpr):  # fmt: skip
    pdl.enter(PDL)
    offs = (tl.program_id(0) * LANES + tl.arange(0, LANES)).to(tl.int64) * PIECE
    bulk_prefetch(w_ptr.to(tl.pointer_type(tl.int8)), offs, nbytes, PIECE)


def prefetch_weight(weight: torch.Tensor | None, rows: int) -> None:
    """paged.model.ops' prefetch_weight on CUDA: the whole tensor into L2 at up to MAX_ROWS
    rows (a contiguous weight on the GPU; anything else is left alone)."""
    if weight is None or rows > MAX_ROWS or not weight.is_cuda or not weight.is_contiguous():
        return
    nbytes = weight.numel() * weight.element_size()
    grid = (triton.cdiv(nbytes, PIECE * LANES),)
    _prefetch_kernel[grid](weight, nbytes, PIECE=PIECE, LANES=LANES, **pdl.launch())
