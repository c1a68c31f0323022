"""Host time of packing one decode step's inputs (InputBuffers.pack_host: token ids,
positions, block tables and slot mappings per KV-cache group), with stand-in requests that
each list --blocks blocks, on the CPU (no model, no device copies).

    python bench/pack_inputs.py [--batch 256] [--blocks 128] [--groups 1,2,6] [--steps 64]

Each step every request decodes one token and gets a new block when its last one is full
(every 16 tokens), so the tables change as in serving. Prints ms per step. To compare with an
older tree, run it with that tree's core first on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import time

import torch

from paged.sampling.params import SamplingParams
from paged.scheduled import ScheduledBatch
from paged.worker.input_buffers import InputBuffers


class Decoding:
    """A decoding request as the input buffers read it (a RequestView)."""

    params = SamplingParams(temperature=0)
    num_pending = 0

    def __init__(self, i: int, blocks: int, groups: int) -> None:
        self.request_id = f"r{i}"
        self.token_ids = list(range(blocks * 16 - 8))
        self.num_prompt_tokens = 1
        self.num_computed_tokens = len(self.token_ids) - 1
        first = 1 + i * blocks * groups
        self.group_block_ids = [list(range(first + g * blocks, first + (g + 1) * blocks))
                                for g in range(groups)]  # fmt: skip
        self.block_version = 0

    block_ids = property(lambda self: self.group_block_ids[0])
    num_tokens = property(lambda self: len(self.token_ids))

    def advance(self, new_block: int) -> None:
        """One more token; a new block in every group when the last one is full."""
        self.token_ids.append(7)
        self.num_computed_tokens += 1
        if len(self.token_ids) > 16 * len(self.block_ids):
            for ids in self.group_block_ids:
                ids.append(new_block)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=128)
    ap.add_argument("--groups", default="1,2,6")
    ap.add_argument("--steps", type=int, default=64)
    args = ap.parse_args()
    for groups in map(int, args.groups.split(",")):
        width = args.blocks + args.steps // 16 + 2
        buf = InputBuffers(8192, args.batch, width, 16, torch.device("cpu"), False, groups)
        reqs = [Decoding(i, args.blocks, groups) for i in range(args.batch)]
        batch = ScheduledBatch()
        batch.reqs, batch.num_new, batch.num_decodes = reqs, [1] * args.batch, args.batch
        buf.pack_host(batch, None)  # first sight of every request
        spent = 0.0
        for step in range(args.steps):
            for r in reqs:
                r.advance(10**6 + step)
            t = time.perf_counter()
            buf.pack_host(batch, None)
            spent += time.perf_counter() - t
        print(f"{groups} KV group(s), batch {args.batch} x {args.blocks} blocks: "
              f"{spent * 1e3 / args.steps:.2f} ms a step")  # fmt: skip


if __name__ == "__main__":
    main()
