"""Head sizes the Triton kernels run (importable without triton, for start-up checks)."""

from __future__ import annotations

MAX_HEAD_DIM = 256  # larger heads exceed the kernels' register and shared-memory tiles


def head_pad(head_dim: int) -> int:
    """The power-of-two tile width (>= 16, tl.dot's least K) a head of `head_dim` is masked to."""
    return max(16, 1 << (head_dim - 1).bit_length())


def unsupported_head_dim(head_dim: int) -> str | None:
    """Why the Triton kernels cannot run heads of this size, or None."""
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        return f"head size {head_dim} is not supported by the Triton kernels (1 to {MAX_HEAD_DIM})"
    return None
