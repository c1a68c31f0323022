"""HIP graphs for decode steps through torch's graph API (`torch.cuda.CUDAGraph` records a
hipGraph on ROCm builds). Captured at start-up for a set of batch sizes and replayed with the
batch padded up to the nearest one; prefill steps, and every step after a failed capture,
run eagerly."""

from __future__ import annotations

import bisect
import logging
import time

import torch
from tqdm import tqdm

from paged.model.attention import AttentionMetadata
from paged.step_runner import StepRunner

log = logging.getLogger("paged")


def capture_sizes(max_num_seqs: int) -> list[int]:
    top = min(max_num_seqs, 512)
    sizes = [s for s in (1, 2, 4, 8) if s <= top] + list(range(16, top + 1, 16))
    return sorted(set(sizes + [top]))


class HipGraphStepRunner(StepRunner):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.sizes: list[int] = []

    def _static_inputs(self, top: int) -> None:
        cfg, dev = self.config, self.platform.device
        max_blocks = -(-cfg.max_model_len // cfg.block_size)
        self.input_ids = torch.zeros(top, dtype=torch.long, device=dev)
        self.positions = torch.zeros(top, dtype=torch.long, device=dev)
        self.slots = torch.full((top,), -1, dtype=torch.long, device=dev)
        self.seq_lens = torch.zeros(top, dtype=torch.int32, device=dev)
        self.tables = torch.zeros(top, max_blocks, dtype=torch.int32, device=dev)
        self.qsl = torch.arange(top + 1, dtype=torch.int32, device=dev)

    def _meta(self, n: int) -> AttentionMetadata:
        from paged.kernels import choose_num_splits

        max_len = self.config.max_model_len
        meta = AttentionMetadata(
            num_reqs=n,
            num_decodes=n,
            num_tokens=n,
            query_start_loc=self.qsl[: n + 1],
            seq_lens=self.seq_lens[:n],
            block_tables=self.tables[:n],
            slot_mapping=self.slots[:n],
            max_query_len=1,
            max_seq_len=max_len,
        )
        splits = choose_num_splits(n, self.backend.num_kv_heads, max_len)
        return self.backend.plan(meta, num_splits=splits)  # fixed splits: graph-safe

    def capture(self) -> None:
        if self.config.enforce_eager:
            return
        sizes = capture_sizes(self.config.max_num_seqs)
        self._static_inputs(sizes[-1])
        self.backend.ensure_workspace(sizes[-1])
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        try:
            for n in tqdm(list(reversed(sizes)), desc="Capturing HIP graphs", leave=False):
                meta = self._meta(n)
                with torch.inference_mode():
                    for _ in range(2):  # warm-up: Triton compiles outside the capture
                        self.model(self.input_ids[:n], self.positions[:n], meta)
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        out = self.model(self.input_ids[:n], self.positions[:n], meta)
                self.graphs[n] = (graph, out)
        except RuntimeError as e:  # a driver or op that cannot be captured: stay eager
            log.warning("HIP graph capture failed, running eagerly: %s", e)
            self.graphs.clear()
            return
        torch.cuda.synchronize()
        self.sizes = sizes
        log.info(
            "captured %d HIP graphs (decode batch 1..%d) in %.1f s",
            len(self.graphs),
            sizes[-1],
            time.perf_counter() - t0,
        )

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        n = meta.num_reqs
        if not self.graphs or meta.num_decodes != n or n > self.sizes[-1]:
            return super().forward(input_ids, positions, meta)
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        graph, out = self.graphs[size]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slots[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        width = meta.block_tables.shape[1]
        self.tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        if size > n:  # padding rows attend to nothing and write nowhere
            self.slots[n:size].fill_(-1)
            self.seq_lens[n:size].fill_(0)
        graph.replay()
        return out[:n]
