"""InputBuffers against a device that runs its copies late, as a GPU stream does when the host
runs several prefill chunks ahead (the cause of long-prompt crashes on the H200)."""

from __future__ import annotations

import torch

from paged.engine.request import Request
from paged.sampling.params import SamplingParams
from paged.scheduled import ScheduledBatch
from paged.worker.input_buffers import InputBuffers


class LateDevice(InputBuffers):
    """Copies are queued and run only when an event after them is waited on, or at the end."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.queue: list[tuple[torch.Tensor, torch.Tensor]] = []  # (host view, device copy)
        self.ran = 0  # copies of the queue already run

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        dst = torch.full(host.shape, -7, dtype=host.dtype)
        self.queue.append((host, dst))  # the host view is read when the copy runs
        return dst

    def run_device(self, upto: int | None = None) -> None:
        for host, dst in self.queue[self.ran : upto]:
            dst.copy_(host)
        self.ran = max(self.ran, len(self.queue) if upto is None else upto)

    def mark_copied(self):
        device, mark = self, len(self.queue)

        class Event:
            def synchronize(self) -> None:
                device.run_device(mark)

        return Event()


def _chunk(req: Request, n: int) -> ScheduledBatch:
    return ScheduledBatch([req], [n], 0)


def test_host_buffers_are_not_reused_before_the_device_copied_them():
    bs, chunk = 16, 32
    bufs = LateDevice(chunk, 4, 16, bs, torch.device("cpu"), False)
    req = Request("long", list(range(1, 4 * chunk + 1)), SamplingParams())
    expected, got = [], []
    for _ in range(4):  # four chunks of one long prompt, none of them sampling
        s = req.num_computed_tokens
        req.block_ids = list(range(100, 100 + (s + chunk) // bs))  # the scheduler's growth
        ids, pos, meta, _, _ = bufs.pack(_chunk(req, chunk))
        expected.append((req.token_ids[s : s + chunk], list(range(s, s + chunk)), s + chunk))
        got.append((ids, pos, meta))
        req.num_computed_tokens += chunk
    bufs.run_device()
    for (ids, pos, meta), (e_ids, e_pos, e_seq) in zip(got, expected):
        assert ids.tolist() == e_ids
        assert pos.tolist() == e_pos
        assert meta.seq_lens.tolist() == [e_seq]
        assert meta.block_tables.tolist() == [list(range(100, 100 + e_seq // bs))]


def test_every_section_starts_on_16_bytes_whatever_the_step_sizes():
    """A Triton kernel is compiled per 16-byte alignment of each pointer it gets: the step's
    views (positions, slots and tables of every KV group, seq_lens, logits rows) start aligned
    for any number of requests and tokens, and hold the step's values."""
    bs, g = 4, 2
    bufs = InputBuffers(64, 8, 16, bs, torch.device("cpu"), False, num_groups=g)
    for n_reqs, lens in [(1, [3]), (2, [1, 4]), (3, [5, 1, 1]), (5, [1, 2, 3, 1, 2])]:
        reqs = []
        for i, n in enumerate(lens):
            r = Request(f"r{n_reqs}-{i}", list(range(7, 7 + n + 2)), SamplingParams())
            r.num_computed_tokens = 2  # a cached start: positions begin at 2
            r.group_block_ids = [[off + 10 * i + j for j in range(3)] for off in (0, 50)]
            r.block_ids = r.group_block_ids[0]
            reqs.append(r)
        ids, pos, meta, rows, _ = bufs.pack(ScheduledBatch(reqs, lens, 0))
        views = [pos, rows, meta.seq_lens, meta.query_start_loc]
        for m in [meta, *meta.group_views]:
            views += [m.slot_mapping, m.block_tables]
        assert all(v.data_ptr() % 16 == 0 for v in views), (n_reqs, lens)
        assert pos.tolist() == [2 + k for n in lens for k in range(n)]
        assert meta.seq_lens.tolist() == [2 + n for n in lens]
        assert meta.query_start_loc.tolist() == [0, *torch.tensor(lens).cumsum(0).tolist()]
        for m, off in zip([meta, *meta.group_views], [0, 50]):
            assert m.block_tables.tolist() == [[off + 10 * i + j for j in range(3)]
                                               for i in range(n_reqs)]  # fmt: skip
            assert m.slot_mapping.tolist() == [(off + 10 * i + p // bs) * bs + p % bs
                                               for i, n in enumerate(lens)
                                               for p in range(2, 2 + n)]  # fmt: skip
