"""Packs a scheduled batch into two flat host buffers (numpy index math, no per-token Python)
and moves them to the device in two copies; every per-step tensor is a view of those.

Two sets of host buffers alternate. The copies are asynchronous where the buffers are pinned:
a set is reused only after the device has run the copies made from it two steps earlier (an
event recorded after them). Steps that sample wait for their results anyway, but a long prompt's
middle chunks do not, and the host can run several chunks ahead of the device."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from paged.model.attention import AttentionMetadata
from paged.scheduled import ScheduledBatch

HEADER = 9  # ints describing a packed step: see InputBuffers.pack_host


def _up(n: int, k: int) -> int:
    return -(-n // k) * k


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a step's sections start in the two buffers (in elements). Each section, and each
    KV group's slots and table, starts on a 16-byte boundary: a Triton kernel specialises a
    pointer argument on 16-byte alignment, so a view whose alignment followed the step's sizes
    (positions after an odd number of tokens, say) would be a kernel variant of its own, compiled
    the first time a step met it: up to a second in the middle of serving."""

    pos: int  # int64: token ids at 0, then positions
    slots: int  # a KV group's slot mapping every `slot_stride`
    slot_stride: int
    rows: int  # logits rows
    fills: int
    copies: int
    end64: int
    seq: int  # int32: query_start_loc at 0, then seq_lens
    tables: int  # a group's block table every `table_stride`
    table_stride: int
    end32: int

    @classmethod
    def of(cls, header: list[int], num_groups: int) -> Layout:
        b, t, width, nl, nfill = header[:5]
        ncopy, g = header[8], num_groups
        pos = _up(t, 2)
        slots = pos + _up(t, 2)
        rows = slots + g * _up(t, 2)
        fills = _up(rows + nl, 2)
        copies = _up(fills + 2 * nfill, 2)
        seq = _up(b + 1, 4)
        tables = _up(seq + b, 4)
        stride = _up(b * width, 4)
        return cls(pos, slots, _up(t, 2), rows, fills, copies, copies + 2 * ncopy, seq, tables,
                   stride, tables + g * stride)  # fmt: skip


def buffer_sizes(max_tokens: int, max_reqs: int, max_blocks: int, g: int) -> tuple[int, int]:
    """Elements of the int64 and int32 buffers for the largest step (with Layout's padding)."""
    n64 = (3 + g) * max_tokens + 5 * max_reqs + 2 * (g + 6)
    return n64, 2 * max_reqs + 1 + g * max_reqs * max_blocks + 4 * (g + 3)


class InputBuffers:
    def __init__(
        self,
        max_tokens: int,
        max_reqs: int,
        max_blocks: int,
        block_size: int,
        device: torch.device,
        pin: bool,
        num_groups: int = 1,
    ) -> None:
        """`num_groups`: KV-cache groups (model/kv_groups.py), a table and slots each."""
        self.block_size = block_size
        self.device = device
        self.num_groups = g = num_groups
        # int64: token ids | positions | slots per group | logits rows (sampling rows, then
        #        the prompt rows of prompt_logprobs requests) | placeholder fills (index, row)
        #        | block copies (sources, destinations: at most one per request)
        # int32: qsl | seq_lens | table per group (each on a 16-byte boundary: Layout)
        n64, n32 = buffer_sizes(max_tokens, max_reqs, max_blocks, g)
        self.sets = [
            (torch.zeros(n64, dtype=torch.int64, pin_memory=pin),
             torch.zeros(n32, dtype=torch.int32, pin_memory=pin))
            for _ in range(2)
        ]  # fmt: skip
        self.copied: list = [None, None]  # per set: an event after its last copies, or None
        self.turn = 0
        self.block_copies: torch.Tensor | None = None  # the loaded step's [2, n] on the device
        # With prompt_logprobs rows: where the sampling rows and the prompt rows (each in the
        # batch's order) sit among the logits rows. Set by pack_host (the driver's).
        self.row_split: tuple[np.ndarray, np.ndarray] | None = None
        self.rows = BlockRows(num_groups, 2 * max_reqs)

    def pack(
        self, batch: ScheduledBatch, prev_rows: dict[str, int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor, torch.Tensor | None]:
        """(input ids, positions, metadata, logits rows, fills). Input tokens that are still
        placeholders (sampled by the step in flight) are listed in `fills`, a [2, n] device
        tensor of (input index, row of the previous step's sampled tokens, from `prev_rows`)."""
        return self.load(self.pack_host(batch, prev_rows))

    def take_set(self) -> None:
        """Switch to the other set of host buffers, once the device has read it."""
        turn = self.turn
        self.turn ^= 1
        if self.copied[turn] is not None:  # the device may still be reading this set
            self.copied[turn].synchronize()
            self.copied[turn] = None
        self.i64, self.i32 = self.sets[turn]

    def pack_host(self, batch: ScheduledBatch, prev_rows: dict[str, int] | None) -> list[int]:
        """Fill a set of host buffers with the step; returns its header (the sizes `load`
        and other ranks need: HEADER ints)."""
        self.take_set()
        reqs, bs, g = batch.reqs, self.block_size, self.num_groups
        b = len(reqs)
        q = np.asarray(batch.num_new, dtype=np.int64)
        starts = np.fromiter((r.num_computed_tokens for r in reqs), dtype=np.int64, count=b)
        ends = np.cumsum(q)
        t = int(ends[-1])
        seq = starts + q
        positions = np.arange(t, dtype=np.int64) + np.repeat(starts - (ends - q), q)
        width = max(len(r.block_ids) for r in reqs)  # every group's lists are as long
        table = self.rows.table(reqs, width)
        req_idx = np.repeat(np.arange(b), q)
        slots = table[:, req_idx, positions // bs].astype(np.int64) * bs + positions % bs
        # Logits only where a request finishes its prompt or decodes (not mid-prompt chunks).
        totals = np.fromiter((r.num_tokens for r in reqs), dtype=np.int64, count=b)
        pools = np.fromiter((r.params.pooling is not None for r in reqs), dtype=bool, count=b)
        last = (ends - 1)[(seq >= totals) & ~pools]  # embedding requests sample nothing
        if batch.spec:  # a verifying request: logits at its last token and each proposal
            owner = np.searchsorted(ends - 1, last).tolist()  # the request of each row
            k = np.array([len(batch.spec.get(reqs[i].request_id, ())) for i in owner], np.int64)
            first = np.cumsum(k + 1) - (k + 1)
            last = np.repeat(last - k, k + 1) + np.arange(int(k.sum()) + len(k)) - np.repeat(
                first, k + 1
            )
        prompt_rows = [  # prompt_logprobs: the rows before the last prompt token's
            np.arange(e - n, e - n + max(0, min(n, r.num_prompt_tokens - 1 - s)))
            for r, s, n, e in zip(reqs, starts.tolist(), batch.num_new, ends.tolist())
            if r.params.prompt_logprobs is not None
        ]
        self.row_split = None
        prompt_rows = [rows for rows in prompt_rows if len(rows)]
        if prompt_rows:  # all rows in input order (forward may skip indexing all of them)
            rows = np.concatenate([last, *prompt_rows])
            order = np.argsort(rows, kind="stable")
            at = np.empty_like(order)
            at[order] = np.arange(len(order))
            self.row_split = (at[: len(last)], at[len(last) :])
            last = rows[order]
        n64 = self.i64.numpy()
        off, fills = 0, []
        for r, s, n in zip(reqs, starts.tolist(), batch.num_new):
            toks = r.token_ids[s : s + n]
            if len(toks) < n:  # after a verifying request's last token: its proposals
                toks = toks + batch.spec[r.request_id]
            n64[off : off + n] = toks
            off += n
            if r.num_pending and s + n > r.num_tokens - r.num_pending:
                # Only the newest token can be pending when a step is scheduled.
                fills.append((off - 1, prev_rows[r.request_id]))
        copies, nl = batch.block_copies, len(last)
        head = [b, t, width, nl, len(fills), batch.num_decodes, int(q.max()), int(seq.max())]
        header = [*head, len(copies)]
        at = Layout.of(header, g)
        n64[at.pos : at.pos + t] = positions
        n64[at.slots : at.rows].reshape(g, at.slot_stride)[:, :t] = slots
        n64[at.rows : at.rows + nl] = last
        if fills:
            n64[at.fills : at.fills + 2 * len(fills)] = np.asarray(fills).T.ravel()
        if copies:
            n64[at.copies : at.end64] = np.asarray(copies).T.ravel()
        n32 = self.i32.numpy()
        n32[0] = 0
        n32[1 : b + 1] = ends
        n32[at.seq : at.seq + b] = seq
        n32[at.tables : at.end32].reshape(g, at.table_stride)[:, : b * width] = table.reshape(g, -1)
        return header

    def views(self, header: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The used part of the current host buffers (int64, int32) for a step's header."""
        return self._used(Layout.of(header, self.num_groups))

    def _used(self, at: Layout) -> tuple[torch.Tensor, torch.Tensor]:
        return self.i64[: at.end64], self.i32[: at.end32]

    def load(
        self, header: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor, torch.Tensor | None]:
        """Copy the current host buffers to the device; the step's tensors as `pack` returns."""
        b, t, width, nl, nfill, num_decodes, max_query_len, max_seq_len, ncopy = header
        g, at = self.num_groups, Layout.of(header, self.num_groups)
        h64, h32 = self._used(at)
        ends = h32[1 : b + 1].numpy()
        d64, d32 = self.to_device(h64), self.to_device(h32)
        self.copied[self.turn ^ 1] = self.mark_copied()
        slots = d64[at.slots : at.rows].view(g, at.slot_stride)[:, :t]
        tables = d32[at.tables : at.end32].view(g, at.table_stride)[:, : b * width]
        tables = tables.view(g, b, width)
        meta = AttentionMetadata(
            num_reqs=b,
            num_decodes=num_decodes,
            num_tokens=t,
            query_start_loc=d32[: b + 1],
            seq_lens=d32[at.seq : at.seq + b],
            block_tables=tables[0],
            slot_mapping=slots[0],
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            query_lens_cpu=np.diff(ends, prepend=0).tolist(),
            seq_lens_cpu=h32[at.seq : at.seq + b].tolist(),
        )
        meta.group_views = [
            dataclasses.replace(meta, block_tables=tables[i], slot_mapping=slots[i], group_views=[])
            for i in range(1, g)
        ]
        fill = d64[at.fills : at.fills + 2 * nfill].view(2, -1) if nfill else None
        self.block_copies = d64[at.copies : at.end64].view(2, -1) if ncopy else None
        return d64[:t], d64[at.pos : at.pos + t], meta, d64[at.rows : at.rows + nl], fill

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        return host.to(self.device, non_blocking=True)

    def mark_copied(self):
        """An event that completes once the copies queued so far have run (None: synchronous,
        as on the CPU, where the "device" tensors are the host buffers themselves)."""
        if self.device.type == "cpu":
            return None
        event = torch.Event(device=self.device)
        event.record()
        return event


class BlockRows:
    """Requests' block tables kept between steps, a row per request (and group): a step
    converts only the block ids appended since the last, and a request's whole row again when
    its `block_version` changed (blocks released, replaced or freed: engine/kv_cache.py) or
    when it has none (a stand-in view: draft, profile). Rows of requests gone are reused once
    the rows run out."""

    def __init__(self, num_groups: int, capacity: int) -> None:
        self.num_groups = num_groups
        self.capacity = capacity
        self.ids = np.zeros((num_groups, capacity, 16), dtype=np.int32)
        self.slot: dict[str, int] = {}  # request id -> its row
        self.synced: list[tuple[int, int | None]] = [(0, None)] * capacity  # (length, version)
        self.free = list(range(capacity - 1, -1, -1))

    def table(self, reqs: list, width: int) -> np.ndarray:
        """`[groups, len(reqs), width]` block tables of `reqs` (zeros past each one's)."""
        if width > self.ids.shape[2]:  # longer rows: wider storage (doubling)
            grown = np.zeros((*self.ids.shape[:2], max(width, 2 * self.ids.shape[2])), np.int32)
            grown[:, :, : self.ids.shape[2]] = self.ids
            self.ids = grown
        rows = [self._sync(r, reqs) for r in reqs]
        return self.ids[:, rows, :width]

    def _sync(self, req, batch: list) -> int:
        slot = self.slot.get(req.request_id)
        if slot is None:
            slot = self._take(batch)
            self.slot[req.request_id] = slot
        lists = req.group_block_ids if self.num_groups > 1 else [req.block_ids]
        n, version = len(lists[0]), getattr(req, "block_version", None)
        have, had = self.synced[slot]
        start = have if version is not None and version == had and n >= have else 0
        if start < n:
            for g, ids in enumerate(lists):
                self.ids[g, slot, start:n] = ids[start:] if start else ids
        if n < have:
            self.ids[:, slot, n:have] = 0
        self.synced[slot] = (n, version)
        return slot

    def _take(self, batch: list) -> int:
        if not self.free:  # every row taken: free those of requests not in this step
            keep = {r.request_id for r in batch}
            for rid in [rid for rid in self.slot if rid not in keep]:
                self.free.append(self.slot.pop(rid))
        slot = self.free.pop()
        self.synced[slot] = (self.synced[slot][0], None)  # rewritten, the old tail zeroed
        return slot
