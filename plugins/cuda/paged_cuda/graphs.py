"""CUDA graphs for decode steps: paged's `AcceleratorGraphStepRunner` (captured at start-up
for a set of batch sizes, replayed with the batch padded up to the nearest captured size;
prefill steps run eagerly) on `torch.cuda.CUDAGraph`. A failed capture raises."""

from __future__ import annotations

from paged.accelerator import AcceleratorGraphStepRunner


class CudaGraphStepRunner(AcceleratorGraphStepRunner):
    graph_class = "CUDAGraph"
    graph_name = "CUDA"
    eager_fallback = False
