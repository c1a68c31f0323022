"""Packs a scheduled batch into two flat host buffers (numpy index math, no per-token Python)
and moves them to the device in two copies; every per-step tensor is a view of those."""

from __future__ import annotations

import numpy as np
import torch

from paged.engine.scheduler import Batch
from paged.model.attention import AttentionMetadata


class InputBuffers:
    def __init__(
        self,
        max_tokens: int,
        max_reqs: int,
        max_blocks: int,
        block_size: int,
        device: torch.device,
        pin: bool,
    ) -> None:
        self.block_size = block_size
        self.device = device
        # int64: token ids | positions | slots | logits rows;  int32: qsl | seq_lens | table
        self.i64 = torch.zeros(4 * max_tokens, dtype=torch.int64, pin_memory=pin)
        self.i32 = torch.zeros(
            2 * max_reqs + 1 + max_reqs * max_blocks, dtype=torch.int32, pin_memory=pin
        )
        self.n64, self.n32 = self.i64.numpy(), self.i32.numpy()

    def pack(
        self, batch: Batch
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        reqs, bs = batch.reqs, self.block_size
        b = len(reqs)
        q = np.asarray(batch.num_new, dtype=np.int64)
        starts = np.fromiter((r.num_computed_tokens for r in reqs), dtype=np.int64, count=b)
        ends = np.cumsum(q)
        t = int(ends[-1])
        seq = starts + q
        positions = np.arange(t, dtype=np.int64) + np.repeat(starts - (ends - q), q)
        width = max(len(r.block_ids) for r in reqs)
        table = np.zeros((b, width), dtype=np.int32)
        for i, r in enumerate(reqs):
            table[i, : len(r.block_ids)] = r.block_ids
        req_idx = np.repeat(np.arange(b), q)
        slots = table[req_idx, positions // bs].astype(np.int64) * bs + positions % bs
        # Logits only where a request finishes its prompt or decodes (not mid-prompt chunks).
        totals = np.fromiter((r.num_tokens for r in reqs), dtype=np.int64, count=b)
        last = (ends - 1)[seq >= totals]
        n64 = self.n64
        off = 0
        for r, s, n in zip(reqs, starts.tolist(), batch.num_new):
            n64[off : off + n] = r.token_ids[s : s + n]
            off += n
        n64[t : 2 * t] = positions
        n64[2 * t : 3 * t] = slots
        n64[3 * t : 3 * t + len(last)] = last
        n32 = self.n32
        n32[0] = 0
        n32[1 : b + 1] = ends
        n32[b + 1 : 2 * b + 1] = seq
        n32[2 * b + 1 : 2 * b + 1 + b * width] = table.ravel()
        d64 = self.i64[: 3 * t + len(last)].to(self.device, non_blocking=True)
        d32 = self.i32[: 2 * b + 1 + b * width].to(self.device, non_blocking=True)
        seq_list = seq.tolist()
        meta = AttentionMetadata(
            num_reqs=b,
            num_decodes=batch.num_decodes,
            num_tokens=t,
            query_start_loc=d32[: b + 1],
            seq_lens=d32[b + 1 : 2 * b + 1],
            block_tables=d32[2 * b + 1 :].view(b, width),
            slot_mapping=d64[2 * t : 3 * t],
            max_query_len=int(q.max()),
            max_seq_len=max(seq_list),
            query_lens_cpu=list(batch.num_new),
            seq_lens_cpu=seq_list,
        )
        return d64[:t], d64[t : 2 * t], meta, d64[3 * t :]
