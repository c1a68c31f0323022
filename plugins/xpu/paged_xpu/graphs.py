"""XPU graphs for decode steps: paged's `AcceleratorGraphStepRunner` on `torch.xpu.XPUGraph`
(SYCL command graphs; torch >= 2.10 with a Level Zero driver that supports them). Captured at
start-up for batch sizes up to 256 and replayed with the batch padded up to the nearest one;
prefill steps run eagerly, and so does everything after a capture that fails (an op that
records outside the capture queue)."""

from __future__ import annotations

from paged.accelerator import AcceleratorGraphStepRunner


class XpuGraphStepRunner(AcceleratorGraphStepRunner):
    graph_class = "XPUGraph"
    graph_name = "XPU"
    max_capture_size = 256
    eager_fallback = True
