"""Host time of a decode step's KV bookkeeping and input packing, per KV-cache group count, on
the CPU (no model, no device): --batch requests of --context tokens each decode one token a
step; timed separately, KVCacheManager.allocate + cache_full_blocks (the scheduler's part:
new blocks as the last one fills, windowed groups releasing what leaves the window) and
InputBuffers.pack_host (token ids, positions, block tables and slot mappings per group).

    python bench/decode_step_host.py [--batch 256] [--context 2048] [--groups 1,2,6]
        [--window 256] [--steps 64]

Group 0 is global, the others windowed (--window), as Gemma 2 (2 groups) and Gemma 3 (6).
Prints ms per step. To compare with an older tree, put its core first on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import time

import torch

from paged.engine.kv_cache import KVCacheManager
from paged.engine.request import Request
from paged.sampling.params import SamplingParams
from paged.scheduled import ScheduledBatch
from paged.worker.input_buffers import InputBuffers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--groups", default="1,2,6")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--steps", type=int, default=64)
    args = ap.parse_args()
    bs = 16
    for groups in map(int, args.groups.split(",")):
        windows = [None] + [args.window] * (groups - 1)
        per_seq = -(-(args.context + args.steps + 1) // bs)
        kv = KVCacheManager(args.batch * per_seq * groups + 1, bs, True, group_windows=windows)
        buf = InputBuffers(8192, args.batch, per_seq, bs, torch.device("cpu"), False, groups)
        params = SamplingParams(temperature=0, max_tokens=10**6)
        reqs = []
        for i in range(args.batch):
            r = Request(f"r{i}", [(i * 7919 + j) % 30000 for j in range(args.context)], params)
            assert kv.allocate(r, r.num_tokens, kv.find_hit(r))
            r.num_computed_tokens = r.num_tokens - 1
            kv.cache_full_blocks(r)
            reqs.append(r)
        batch = ScheduledBatch()
        batch.reqs, batch.num_new, batch.num_decodes = reqs, [1] * args.batch, args.batch
        buf.pack_host(batch, None)  # first sight of every request
        kv_time = pack_time = 0.0
        for _ in range(args.steps):
            t = time.perf_counter()
            for r in reqs:
                r.token_ids.append(5)
                r.num_computed_tokens += 1
                assert kv.allocate(r, r.num_tokens)
                kv.cache_full_blocks(r)
            t2 = time.perf_counter()
            buf.pack_host(batch, None)
            kv_time, pack_time = kv_time + t2 - t, pack_time + time.perf_counter() - t2
        print(f"{groups} KV group(s), batch {args.batch} x {args.context} tokens: KV manager "
              f"{kv_time * 1e3 / args.steps:.2f} ms, packing {pack_time * 1e3 / args.steps:.2f}"
              " ms a step")  # fmt: skip


if __name__ == "__main__":
    main()
