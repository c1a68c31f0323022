"""XPU graphs for decode steps: paged's `GraphStepRunner` on `torch.xpu.XPUGraph` (SYCL
command graphs; torch >= 2.10 with a Level Zero driver that supports them). Captured at
start-up for batch sizes up to 256 and replayed with the batch padded up to the nearest one;
prefill steps run eagerly, and so does everything after a capture that fails (an op that
records outside the capture queue)."""

from __future__ import annotations

import torch

from paged.graph_runner import GraphStepRunner


class XpuGraphStepRunner(GraphStepRunner):
    graph_name = "XPU"
    max_capture_size = 256
    eager_fallback = True

    def graphs_available(self) -> bool:
        return hasattr(torch.xpu, "XPUGraph")

    def new_graph(self):
        return torch.xpu.XPUGraph()

    def graph_capture(self, graph, pool):
        return torch.xpu.graph(graph, pool=pool)

    def graph_pool(self):
        return torch.xpu.graph_pool_handle()
