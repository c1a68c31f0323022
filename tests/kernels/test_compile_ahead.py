"""Compiling kernel variants ahead on threads (paged.kernels.compile_ahead): launches made
through `launcher` on such a thread compile only (Triton's warmup: on the interpreter, nothing
runs), elsewhere they run; a call that fails is counted, not raised."""

from __future__ import annotations

import threading

import torch

from paged.kernels import compile_ahead as ca
from paged.kernels.fused import fused_add_rms_norm


def test_launches_compile_only_on_the_compiling_threads(device):
    x = torch.randn(2, 64, device=device)
    res = torch.randn(2, 64, device=device)
    g = torch.rand(64, device=device)
    x0, res0 = x.clone(), res.clone()
    failed, _ = ca.compile_ahead([lambda: fused_add_rms_norm(x, res, g, 1e-6)])
    assert failed == 0
    assert torch.equal(x, x0) and torch.equal(res, res0)  # compiled (or, here, nothing): not run
    fused_add_rms_norm(x, res, g, 1e-6)  # this thread launches
    assert torch.allclose(res, x0 + res0)
    assert not torch.equal(x, x0)


def test_launcher_gives_the_warmup_with_the_grid_while_compiling():
    class Kernel:
        def __getitem__(self, grid):
            return ("launch", grid)

        def warmup(self, *args, grid, **kw):
            return ("warmup", grid, args, kw)

    kernel = Kernel()
    assert ca.launcher(kernel, (3, 2)) == ("launch", (3, 2))
    seen = []
    ca.compile_ahead([lambda: seen.append(ca.launcher(kernel, (4,))(1, A=2))])
    assert seen == [("warmup", (4,), (1,), {"A": 2})]
    assert not ca.compiling_only()


def test_calls_run_side_by_side_within_their_context_and_failures_are_counted():
    entered, threads, barrier = [], set(), threading.Barrier(2, timeout=10)

    class Within:
        def __enter__(self):
            entered.append(threading.get_ident())

        def __exit__(self, *exc):
            return False

    def call():
        assert ca.compiling_only()
        threads.add(threading.get_ident())
        barrier.wait()  # both calls at once: two threads

    def broken():
        raise RuntimeError("no such config")

    failed, seconds = ca.compile_ahead([call, call, broken], Within, workers=2)
    assert failed == 1 and seconds >= 0
    assert len(threads) == 2 and len(entered) == 3
    assert ca.compile_ahead([]) == (0, 0.0)


def test_workers_follow_the_cpus_up_to_the_cap(monkeypatch):
    monkeypatch.setattr(ca.os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert ca.default_workers() == ca.MAX_WORKERS
    monkeypatch.setattr(ca.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert ca.default_workers() == 2
