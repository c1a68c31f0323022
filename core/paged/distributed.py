"""Process groups of one engine replica, through torch.distributed.

World = tensor parallel x pipeline parallel ranks; rank = pp_rank * tp_size + tp_rank. Two
groups per tensor-parallel set: one on the platform's backend (`Platform.dist_backend`: nccl,
rccl, xccl, gloo) for the model's collectives, and a gloo group on the host for the
per-step inputs the driver (rank 0) sends. With one rank nothing here is initialised and every
collective is a no-op, so a single-device engine pays nothing.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class ParallelState:
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    tp_group: Any = None  # device collectives of this rank's tensor-parallel set
    cpu_group: Any = None  # gloo: the whole world, host tensors (step inputs from the driver)
    world_group: Any = None  # device backend: the whole world (pipeline sends)

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def stage_rank(self, pp_rank: int) -> int:
        """The global rank of this tensor-parallel position in stage `pp_rank`."""
        return pp_rank * self.tp_size + self.tp_rank


_state = ParallelState()


class WorkerFailure(RuntimeError):
    """A worker process died or stopped answering: the replica cannot run steps any more."""


def parallel() -> ParallelState:
    return _state


def init_distributed(
    backend: str,
    init_method: str,
    rank: int,
    tp_size: int,
    pp_size: int,
    timeout_s: float = 300.0,
) -> ParallelState:
    """Join the replica's process group (every rank calls this once, before building the
    model) and make the tensor-parallel groups."""
    global _state
    world = tp_size * pp_size
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=timeout)  # fmt: skip
    cpu = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
    pp_rank, tp_rank = divmod(rank, tp_size)
    tp_group = None
    for p in range(pp_size):  # every rank creates every group, in the same order
        ranks = list(range(p * tp_size, (p + 1) * tp_size))
        g = dist.new_group(ranks, backend=backend, timeout=timeout)
        if p == pp_rank:
            tp_group = g
    _state = ParallelState(tp_size, tp_rank, pp_size, pp_rank, tp_group, cpu, dist.group.WORLD)
    return _state


def init_distributed_watched(failed: Callable[[], str | None], *args: Any) -> ParallelState:
    """init_distributed for the driver, which waits for every other rank to join: raise
    WorkerFailure as soon as `failed()` names a dead worker, instead of waiting out the
    rendezvous timeout (the join goes on in a daemon thread, given up)."""
    result: list[Any] = []

    def join() -> None:
        try:
            result.append(init_distributed(*args))
        except BaseException as e:
            result.append(e)

    t = threading.Thread(target=join, name="paged-rendezvous", daemon=True)
    t.start()
    while t.is_alive():
        t.join(0.2)
        why = failed()
        if why is not None and t.is_alive():
            raise WorkerFailure(f"{why} (while the replica was starting)")
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


def destroy_distributed() -> None:
    global _state
    if dist.is_initialized():
        dist.destroy_process_group()
    _state = ParallelState()


# ---- the model's collectives (no-ops with one rank) ------------------------------------
def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _state.tp_size > 1:
        dist.all_reduce(x, group=_state.tp_group)
    return x


def tp_gather_first(x: torch.Tensor) -> torch.Tensor | None:
    """Concatenate every tensor-parallel rank's `x` along the last dim on the stage's first
    rank (None elsewhere)."""
    if _state.tp_size == 1:
        return x
    first = _state.stage_rank(_state.pp_rank) - _state.tp_rank
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_state.tp_size)] if _state.tp_rank == 0 else None
    dist.gather(x, parts, dst=first, group=_state.tp_group)
    return torch.cat(parts, dim=-1) if parts is not None else None


def isend_to_stage(tensors: list[torch.Tensor], pp_rank: int) -> list[tuple[Any, torch.Tensor]]:
    """Start sending to a stage without waiting: (work, tensor) pairs; keep them (the tensors
    must live) until each work's wait()."""
    dst = _state.stage_rank(pp_rank)
    out = []
    for t in tensors:
        t = t.contiguous()
        out.append((dist.isend(t, dst, group=_state.world_group), t))
    return out


def recv_from_stage(like: list[torch.Tensor], pp_rank: int) -> list[torch.Tensor]:
    src = _state.stage_rank(pp_rank)
    for t in like:
        dist.recv(t, src, group=_state.world_group)
    return like


# ---- host-side messages from the driver -------------------------------------------------
def broadcast_host(t: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Broadcast a host tensor over the gloo group of the whole world."""
    dist.broadcast(t, src, group=_state.cpu_group)
    return t


def broadcast_object_host(obj: object = None, src: int = 0) -> object:
    """Broadcast a picklable object from `src` over the gloo group (others pass nothing)."""
    box = [obj]
    dist.broadcast_object_list(box, src, group=_state.cpu_group)
    return box[0]


def all_reduce_min_host(value: int) -> int:
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_state.cpu_group)
    return int(t.item())
