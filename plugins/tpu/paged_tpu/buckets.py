"""Static shapes for XLA: bucket sizes and the padded per-step input buffer.

XLA compiles one program per input shape. Every step is padded up to a token bucket (the
model forward) and a request bucket (the sampling tail), all compiled at start-up, so
serving never compiles. Pure numpy: no torch_xla here.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

MIN_TOKENS = 16
MIN_REQS = 8
# Padding tokens write here: out of bounds, so XLA's scatter drops the update (as vLLM's
# TPU runner does); any real slot is below it.
PAD_SLOT = 1 << 30


def pow2_buckets(lo: int, hi: int) -> list[int]:
    """Powers of two from `lo` below `hi`, then `hi`: pow2_buckets(16, 100) = [16, 32, 64, 100]."""
    out, n = [], min(lo, hi)
    while n < hi:
        out.append(n)
        n *= 2
    return [*out, hi]


def pad_to(n: int, buckets: list[int]) -> int:
    """The smallest bucket holding n."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} exceeds the largest compiled size {buckets[-1]}")
    return buckets[i]


@dataclass(frozen=True)
class Buckets:
    tokens: list[int]  # padded token counts: one compiled forward each
    reqs: list[int]  # padded request counts: one compiled sampling tail each
    max_reqs: int  # rows of the request-level metadata (fixed: the forward ignores it)
    max_blocks: int  # block-table width: max_model_len / block_size

    @classmethod
    def from_config(cls, config) -> Buckets:
        top_tokens = max(config.max_num_batched_tokens, config.max_num_seqs)
        max_blocks = -(-config.max_model_len // config.block_size)
        return cls(
            pow2_buckets(MIN_TOKENS, top_tokens),
            pow2_buckets(MIN_REQS, config.max_num_seqs),
            config.max_num_seqs,
            max_blocks,
        )

    @property
    def count(self) -> int:
        """Programs compiled at start-up."""
        return len(self.tokens) + len(self.reqs)


@dataclass(frozen=True)
class Layout:
    """Offsets in the one int32 buffer a step uploads (one host-to-device copy)."""

    tokens: int  # T, a token bucket
    reqs: int  # R, Buckets.max_reqs
    blocks: int  # W, Buckets.max_blocks

    def fields(self) -> dict[str, tuple[int, int]]:
        t, r = self.tokens, self.reqs
        sizes = [
            ("input_ids", t),
            ("positions", t),
            ("slots", t),
            ("req_idx", t),  # the request row of each token
            ("query_start_loc", r + 1),
            ("seq_lens", r),
            ("last_rows", r),  # each request's last token row
            ("num_seqs", 1),
            ("block_tables", r * self.blocks),
        ]
        out, off = {}, 0
        for name, n in sizes:
            out[name] = (off, off + n)
            off += n
        return out

    @property
    def size(self) -> int:
        return 4 * self.tokens + 3 * self.reqs + 2 + self.reqs * self.blocks


def pack_step(
    layout: Layout,
    input_ids: np.ndarray,
    positions: np.ndarray,
    slots: np.ndarray,
    query_start_loc: np.ndarray,
    seq_lens: np.ndarray,
    block_tables: np.ndarray,
) -> np.ndarray:
    """One step's flat varlen batch (t tokens, b requests) padded to `layout`.

    Padding tokens: id 0, position 0, slot PAD_SLOT, request 0 (they attend to one cached
    key and their rows are never read). Padding requests: no query tokens
    (query_start_loc stays at t), seq_len 0, an all-zero block table row.
    """
    t, b, w = len(input_ids), len(seq_lens), block_tables.shape[1]
    if t > layout.tokens or b > layout.reqs or w > layout.blocks:
        raise ValueError(f"step of {t} tokens, {b} requests, {w} blocks exceeds {layout}")
    if t and int(slots.max()) >= PAD_SLOT:
        raise ValueError(f"KV slot {int(slots.max())} reaches the padding slot {PAD_SLOT}")
    buf = np.zeros(layout.size, dtype=np.int32)
    f = layout.fields()

    def put(name: str, values: np.ndarray, fill: int = 0) -> None:
        lo, hi = f[name]
        buf[lo : lo + len(values)] = values
        buf[lo + len(values) : hi] = fill

    qsl = query_start_loc[: b + 1].astype(np.int64)
    put("input_ids", input_ids)
    put("positions", positions)
    put("slots", slots, PAD_SLOT)
    put("req_idx", np.repeat(np.arange(b), np.diff(qsl)))
    put("query_start_loc", qsl, t)
    put("seq_lens", seq_lens)
    put("last_rows", qsl[1:] - 1)
    put("num_seqs", np.array([b]))
    table = np.zeros((layout.reqs, layout.blocks), dtype=np.int32)
    table[:b, :w] = block_tables
    put("block_tables", table.ravel())
    return buf


def dummy_step(layout: Layout) -> np.ndarray:
    """An all-padding step of the layout's shape: compiles its program, changes nothing."""
    empty = np.zeros(0, dtype=np.int64)
    table = np.zeros((0, layout.blocks), dtype=np.int32)
    return pack_step(layout, empty, empty, empty, np.zeros(1, np.int64), empty, table)
