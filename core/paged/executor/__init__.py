"""Executors start the workers of one engine replica and carry each step to them: in this
process alone (one rank), as local processes (`mp`), or as Ray actors across nodes (`ray`)."""

from __future__ import annotations

from paged.config import EngineConfig
from paged.executor.base import Executor, WorkerFailure


def create_executor(config: EngineConfig, exit_on_failure: bool = False) -> Executor:
    """`config`: resolved (paged.worker.worker.resolve_config). `exit_on_failure`: end this
    process when a worker dies and the driver cannot notice (stuck in a collective), as an
    engine-core process does; an offline engine raises instead."""
    if config.world_size == 1:
        return Executor(config)
    if config.distributed_executor_backend == "ray":
        from paged.executor.ray import RayExecutor

        return RayExecutor(config, exit_on_failure)
    from paged.executor.mp import MultiprocExecutor

    return MultiprocExecutor(config, exit_on_failure)


__all__ = ["Executor", "WorkerFailure", "create_executor"]
