"""HIP graphs for decode steps: paged's `GraphStepRunner` through torch's graph API
(`torch.cuda.CUDAGraph` records a hipGraph on ROCm builds). Captured at start-up for a set of
batch sizes and replayed with the batch padded up to the nearest one; prefill steps, and
every step after a failed capture, run eagerly."""

from __future__ import annotations

import torch

from paged.graph_runner import GraphStepRunner


class HipGraphStepRunner(GraphStepRunner):
    graph_name = "HIP"
    eager_fallback = True  # a driver or op that cannot be captured: stay eager

    def new_graph(self) -> torch.cuda.CUDAGraph:
        return torch.cuda.CUDAGraph()

    def graph_capture(self, graph: torch.cuda.CUDAGraph, pool):
        return torch.cuda.graph(graph, pool=pool)

    def graph_pool(self):
        return torch.cuda.graph_pool_handle()
