"""XLA collectives, for tensor parallelism later (the engine runs one device today).

One process per TPU chip (torch_xla's multiprocessing launcher, or one process per host
with SPMD). The torch.distributed backend is "xla" (registered by
`torch_xla.distributed.xla_backend`); inside the model the collectives are traced XLA ops,
so they compile into each bucket's program like any other op.
"""

from __future__ import annotations

import torch


def init_distributed() -> tuple[int, int]:
    """Join the default process group over the "xla" backend: (rank, world size)."""
    import torch.distributed as dist
    import torch_xla.distributed.xla_backend  # noqa: F401  (registers "xla")
    import torch_xla.runtime as xr

    if not dist.is_initialized():
        dist.init_process_group("xla", init_method="xla://")
    return xr.global_ordinal(), xr.world_size()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the tensor-parallel group (row-parallel linear outputs)."""
    import torch_xla.core.xla_model as xm

    return xm.all_reduce(xm.REDUCE_SUM, x)


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate shards along `dim` (column-parallel outputs, the sharded lm_head)."""
    import torch_xla.core.xla_model as xm

    return xm.all_gather(x, dim=dim % x.dim())
