"""Structured outputs' token mask on CPU: xgrammar's C++ kernel (one pass over the logits)."""

from __future__ import annotations

import torch

from paged.model import ops


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None
) -> None:
    """paged.model.ops.apply_token_bitmask, same result."""
    if logits.dtype not in (torch.float32, torch.bfloat16) or logits.dim() != 2:
        return ops.apply_token_bitmask(logits, bitmask, rows)
    from xgrammar.kernels.apply_token_bitmask_inplace_cpu import (
        apply_token_bitmask_inplace_cpu,
    )

    if rows is not None:  # xgrammar's indices pick rows of both: widen the bitmask
        full = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32)
        full[rows] = bitmask
        bitmask, rows = full, rows.tolist()
    apply_token_bitmask_inplace_cpu(logits, bitmask.contiguous(), indices=rows)
