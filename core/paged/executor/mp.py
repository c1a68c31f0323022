"""Ranks 1.. of a replica as local processes (multiprocessing spawn), one per device.

A thread watches them: when one dies the replica is marked failed, the others are stopped,
and the driver's next step raises WorkerFailure. If the driver is stuck in a collective with
the dead rank and cannot notice, an engine-core process exits non-zero after a grace period
(its server then answers 503 and exits), so that nothing hangs.
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import socket
import threading
from multiprocessing.connection import wait

from paged.config import EngineConfig
from paged.executor.base import Executor
from paged.logs import configure_logging

log = logging.getLogger("paged")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_main(config: EngineConfig, rank: int, init_method: str, log_level: int) -> None:
    """A worker process: build this rank's part, size and allocate its KV cache in step with
    the others, then follow the driver's steps until it says stop."""
    from paged.worker.worker import Worker, follow_steps

    configure_logging(log_level)
    for sig in (signal.SIGINT, signal.SIGHUP):  # the engine above stops us
        signal.signal(sig, signal.SIG_IGN)
    worker = Worker(config, rank, init_method)
    worker.init_cache(worker.num_blocks())
    follow_steps(worker)
    from paged.distributed import destroy_distributed

    destroy_distributed()


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, exit_on_failure: bool = False) -> None:
        self.exit_on_failure = exit_on_failure
        self.procs: list = []
        self._stopping = False
        super().__init__(config)

    def start_workers(self) -> str:
        init_method = f"tcp://127.0.0.1:{free_port()}"
        ctx = multiprocessing.get_context("spawn")
        level = logging.getLogger().getEffectiveLevel()
        for rank in range(1, self.config.world_size):
            p = ctx.Process(target=worker_main, args=(self.config, rank, init_method, level),
                            name=f"paged-worker-{rank}", daemon=True)  # fmt: skip
            p.start()
            self.procs.append(p)
        threading.Thread(target=self._watch, name="paged-worker-watch", daemon=True).start()
        return init_method

    def _watch(self) -> None:
        sentinels = {p.sentinel: p for p in self.procs}
        while sentinels and not self._stopping:
            ready = wait(list(sentinels), timeout=1.0)
            if not ready or self._stopping:
                continue
            p = sentinels[ready[0]]
            p.join(1)
            self.worker_died(f"worker {p.name} exited with code {p.exitcode}")
            return

    def stop_workers(self) -> None:
        self._stopping = True
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(2)

    def shutdown(self) -> None:
        self._stopping = True
        super().shutdown()
