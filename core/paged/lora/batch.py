"""One step's tokens grouped by LoRA slot, as the kernels read them from one static device
buffer (captured graphs read it in place; the runner rewrites it before every forward):

    [starts (slots + 1) | blocks of 16 (slots + 1) | blocks of 64 (slots + 1) | token ids]

`token_ids[starts[s]:starts[s+1]]` are the tokens of slot s (tokens without an adapter are in
no run); `blocks{16,64}[s]` is where slot s's runs of BLOCK_M tokens start among all slots'
blocks, so a kernel's grid needs only tokens / BLOCK_M + slots programs along M and each
finds its slot with a compare against these offsets.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

BLOCK_SIZES = (16, 64)  # the kernels' BLOCK_M choices (paged.kernels.lora)


@dataclass
class LoRABatch:
    token_ids: torch.Tensor
    starts: torch.Tensor
    blocks: dict[int, torch.Tensor]  # BLOCK_M -> per-slot block offsets [slots + 1]
    starts_host: list[int] = field(default_factory=list)  # starts on the host (torch path)
    # True when no token of this step has an adapter: eager forwards skip the LoRA kernels
    # (a captured graph runs them; with empty runs they exit at once).
    empty: bool = False

    @property
    def num_slots(self) -> int:
        return self.starts.shape[0] - 1

    @classmethod
    def on(cls, buf: torch.Tensor, slots: int) -> LoRABatch:
        """Views of a buffer laid out as this module describes."""
        n = slots + 1
        blocks = {bm: buf[(i + 1) * n : (i + 2) * n] for i, bm in enumerate(BLOCK_SIZES)}
        head = (len(BLOCK_SIZES) + 1) * n
        return cls(buf[head:], buf[:n], blocks, [0] * n)


def buffer_size(slots: int, max_tokens: int) -> int:
    return (len(BLOCK_SIZES) + 1) * (slots + 1) + max_tokens


def pack(token_slot: np.ndarray, slots: int) -> tuple[np.ndarray, list[int]]:
    """(the buffer's used part, starts) for tokens' slots (-1: no adapter)."""
    counts = np.bincount(token_slot[token_slot >= 0], minlength=slots)
    starts = np.zeros(slots + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    parts = [starts]
    for bm in BLOCK_SIZES:
        blk = np.zeros(slots + 1, dtype=np.int64)
        np.cumsum(-(-counts // bm), out=blk[1:])
        parts.append(blk)
    order = np.argsort(token_slot, kind="stable")[len(token_slot) - int(starts[-1]) :]
    parts.append(order.astype(np.int64))
    return np.concatenate(parts), starts.tolist()
