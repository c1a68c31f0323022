"""CUDA graphs for decode steps: paged's `GraphStepRunner` (captured at start-up for a set of
batch sizes, replayed with the batch padded up to the nearest captured size; prefill steps
run eagerly) on `torch.cuda.CUDAGraph`. A failed capture raises."""

from __future__ import annotations

import torch

from paged.graph_runner import GraphStepRunner


class CudaGraphStepRunner(GraphStepRunner):
    graph_name = "CUDA"
    eager_fallback = False

    def new_graph(self) -> torch.cuda.CUDAGraph:
        return torch.cuda.CUDAGraph()

    def graph_capture(self, graph: torch.cuda.CUDAGraph, pool):
        return torch.cuda.graph(graph, pool=pool)

    def graph_pool(self):
        return torch.cuda.graph_pool_handle()
