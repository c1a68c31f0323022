"""One rank of an engine replica: its device, its part of the model, its KV cache.

Rank 0 (the driver) lives in the engine process and runs the steps the scheduler hands it;
with more ranks it first sends each step's packed inputs (a few host arrays, no per-request
objects) to the others over the host group, and they run the same forward in lockstep
(`follow_steps`). Only the driver computes logits over the whole vocabulary and samples.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from paged.config import EngineConfig, check_batch, check_max_model_len, model_max_len
from paged.distributed import (
    all_reduce_min_host,
    broadcast_host,
    init_distributed,
    init_distributed_watched,
)
from paged.model import ops
from paged.model.parallel import check_split
from paged.model.registry import check_supported
from paged.plugins import select_platform
from paged.worker.input_buffers import HEADER
from paged.worker.model_runner import STEP_EVERY_ROW, STOP, ModelRunner

log = logging.getLogger("paged")


def load_model_config(config: EngineConfig):
    """(hf_config, ModelSource or None) for the config's model or named dummy shape."""
    from paged.model.shapes import SHAPES, shape_config

    if config.load_format == "dummy" and config.model and config.model.lower() in SHAPES:
        return shape_config(config.model), None
    from paged.model.loader import load_config, resolve_model

    src = resolve_model(config.model, config.load_format, config.revision, config.download_dir)
    return load_config(src), src


def resolve_config(config: EngineConfig, platform: Any, hf_config: Any) -> EngineConfig:
    """The engine's own copy of `config`: dtype and context length filled in, checked and
    adjusted by the platform. The caller's object is never changed."""
    dtype = config.dtype
    if dtype == "auto":
        dtype = str(platform.default_dtype()).removeprefix("torch.")
    check_max_model_len(config.max_model_len, hf_config)
    limit = model_max_len(hf_config)[0]
    model_len = getattr(hf_config, "max_position_embeddings", None) or 2048
    model_len = min(model_len, limit or model_len)
    changes: dict[str, Any] = dict(dtype=dtype, max_model_len=config.max_model_len or model_len)
    tokens = config.max_num_batched_tokens or platform.default_max_num_batched_tokens
    changes["max_num_batched_tokens"] = tokens
    if config.max_num_seqs is None:  # the platform's, at most one request a batched token
        changes["max_num_seqs"] = min(platform.default_max_num_seqs, tokens)
    check_batch(changes.get("max_num_seqs", config.max_num_seqs), tokens)
    # before any rank starts (EngineConfig refuses --async-scheduling with several ranks)
    check_split(hf_config, config.tensor_parallel_size, config.pipeline_parallel_size)
    if config.world_size > 1:
        changes["async_scheduling"] = False  # other ranks cannot read the driver's samples
    if config.pipeline_parallel_size > 1 and not config.enforce_eager:
        log.info("pipeline parallel: steps run eagerly (no graph capture)")
        changes["enforce_eager"] = True
    resolved = replace(config, **changes)
    check_supported(hf_config, platform)
    platform.check_config(resolved)
    return resolved


class Worker:
    def __init__(
        self,
        config: EngineConfig,
        rank: int = 0,
        init_method: str | None = None,
        local_rank: int | None = None,
        failed: Callable[[], str | None] | None = None,
    ) -> None:
        """`config`: already resolved (resolve_config). With world_size > 1 this joins the
        replica's process group at `init_method` before building its part of the model;
        `failed` (the driver's): the executor's failure so far, to stop waiting for workers
        that died while starting."""
        t0 = time.perf_counter()
        self.config, self.rank = config, rank
        self.platform = select_platform(config.platform)
        self.platform.configure(config.platform_options)
        if config.world_size > 1:
            self.platform.bind_device(rank if local_rank is None else local_rank)
            if self.platform.device_type == "cpu":  # ranks share the host's cores
                cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
                torch.set_num_threads(max(1, cores // config.world_size))
            tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
            args = (self.platform.dist_backend, init_method or "", rank, tp, pp)
            if failed is None:
                init_distributed(*args)
            else:
                init_distributed_watched(failed, *args)
        self.hf_config, self.source = load_model_config(config)
        weights = None
        if config.load_format != "dummy":
            from paged.model.loader import iter_weights

            weights = iter_weights(self.source, self.hf_config)
        self.runner = ModelRunner(
            config, self.platform, self.hf_config, config.max_model_len, weights, self.source
        )
        self.draft = None  # speculative decoding's draft model or EAGLE head (the driver's)
        spec = config.speculative_config
        if spec is not None and spec.method == "draft_model":
            from paged.spec_decode.draft import build_draft_runner

            self.draft = build_draft_runner(config, self.platform, self.hf_config, self.source)
        elif spec is not None and spec.method in ("eagle", "eagle3"):
            from paged.spec_decode.eagle import build_eagle_runner

            self.draft = build_eagle_runner(config, self.platform, self.hf_config,
                                            self.runner.model)  # fmt: skip
        log.debug("rank %d: model ready in %.1f s", rank, time.perf_counter() - t0)

    def num_blocks(self) -> int:
        """KV cache blocks this rank can hold; the same number on every rank (the least)."""
        cfg = self.config
        sized = cfg.num_kv_blocks is not None or cfg.kv_cache_memory is not None
        if self.platform.needs_profile_run and not sized:
            self.runner.profile_run()
        if cfg.num_kv_blocks is not None:
            blocks = cfg.num_kv_blocks
        else:
            per_block = self.runner.bytes_per_block()
            if self.draft is not None:  # the draft's cache has as many blocks
                per_block += self.draft.bytes_per_block()
            blocks = self.platform.kv_cache_budget(cfg) // per_block
        if cfg.world_size > 1:
            blocks = all_reduce_min_host(blocks)
        # Every KV-cache group's blocks: a windowed group's bounded by its window (released
        # out of it), plus the null block.
        need = self.runner.kv_groups.blocks_needed(
            cfg.max_model_len, cfg.block_size, cfg.max_num_batched_tokens
        )
        if blocks < need:
            raise ValueError(
                f"the KV cache holds {blocks} blocks ({blocks * cfg.block_size} tokens), too few "
                f"for one request of max_model_len={cfg.max_model_len} ({need} blocks): raise "
                f"--kv-cache-memory / --gpu-memory-utilization or lower --max-model-len"
            )
        return blocks

    def init_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)
        ops.install(self.runner.op_table)  # the graphs capture this runner's kernels
        self.runner.step_runner.capture()
        if self.draft is not None:
            self.draft.allocate_kv_cache(num_blocks)
            self.draft.step_runner.capture()
        torch.manual_seed(self.config.seed)  # --seed again: capturing samplers drew numbers

    def shutdown(self) -> None:
        """The driver: tell the other ranks to stop (the executor then ends the group)."""
        if self.config.world_size > 1 and self.rank == 0:
            broadcast_host(torch.tensor([STOP] + [0] * HEADER, dtype=torch.int64))


def follow_steps(worker: Worker) -> None:
    """Ranks other than the driver: run every step the driver sends, until it says stop."""
    runner = worker.runner
    header = torch.empty(1 + HEADER, dtype=torch.int64)
    while True:
        broadcast_host(header)
        kind, *h = header.tolist()
        if kind == STOP:
            return
        runner.inputs.take_set()
        for view in runner.inputs.views(h):
            broadcast_host(view)
        runner.follow(h, every_row=kind == STEP_EVERY_ROW)
