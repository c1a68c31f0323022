"""HIP graphs for decode steps: paged's `AcceleratorGraphStepRunner` through torch's graph API
(`torch.cuda.CUDAGraph` records a hipGraph on ROCm builds). Captured at start-up for a set of
batch sizes and replayed with the batch padded up to the nearest one; prefill steps, and
every step after a failed capture, run eagerly."""

from __future__ import annotations

from paged.accelerator import AcceleratorGraphStepRunner


class HipGraphStepRunner(AcceleratorGraphStepRunner):
    graph_class = "CUDAGraph"  # in torch.cuda, which drives HIP on ROCm builds
    graph_name = "HIP"
    eager_fallback = True  # a driver or op that cannot be captured: stay eager
