"""The executor contract, and the one-rank executor: the driver worker in this process."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from paged.config import EngineConfig
from paged.distributed import WorkerFailure, destroy_distributed
from paged.worker.worker import Worker

log = logging.getLogger("paged")
GRACE_S = 10.0  # after a worker died: time for the driver to notice before the process exits
__all__ = ["Executor", "WorkerFailure"]


class Executor:
    """Rank 0 (the driver) runs in this process; subclasses start the other ranks first
    (`start_workers`) and watch them (`failure`)."""

    exit_on_failure = False  # set by executors that start workers (see create_executor)

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.failure: str | None = None  # why the replica is broken, once it is
        init_method = self.start_workers()
        try:
            self.driver = Worker(config, 0, init_method, failed=lambda: self.failure)
            self.num_blocks = self.driver.num_blocks()
            self.driver.init_cache(self.num_blocks)
        except BaseException:
            self.stop_workers()
            destroy_distributed()
            raise

    @property
    def runner(self) -> Any:
        return self.driver.runner

    def start_workers(self) -> str | None:
        """Start ranks 1.. (each joins the process group at the returned init method)."""
        return None

    def stop_workers(self) -> None:
        pass

    def worker_died(self, why: str) -> None:
        """Called by a watcher thread: fail the replica and stop the other workers. With
        `exit_on_failure` (an engine-core process), exit if the driver has not raised on its
        own within GRACE_S (it may be stuck in a collective with the dead rank)."""
        self.failure = why
        log.error("%s: stopping the replica", why)
        self.stop_workers()
        if self.exit_on_failure:
            time.sleep(GRACE_S)
            log.error("the driver did not stop after the worker failure: exiting")
            os._exit(1)

    def check(self) -> None:
        """Raise WorkerFailure once a worker is gone."""
        if self.failure is not None:
            raise WorkerFailure(self.failure)

    def wait_failure(self, seconds: float) -> str | None:
        """After a step raised: the worker failure behind it, if the watcher reports one
        within `seconds` (a collective can notice a dead peer before the watcher does)."""
        if self.config.world_size == 1:
            return self.failure
        end = time.monotonic() + seconds
        while self.failure is None and time.monotonic() < end:
            time.sleep(0.05)
        return self.failure

    def launch(self, batch: Any, prev: Any = None) -> Any:
        """Run one step on every rank; the driver's StepHandle (it samples)."""
        self.check()
        return self.driver.runner.launch(batch, prev)

    def shutdown(self) -> None:
        try:
            if self.failure is None:
                self.driver.shutdown()  # tells the other ranks to stop
        finally:
            self.stop_workers()
            destroy_distributed()
