"""XlaStepRunner: the model forward on an XLA device at a few static shapes.

Each step runs two XLA programs, both compiled by `capture()` at start-up:
- the forward, per token bucket T: the step padded to T tokens (request metadata padded to
  max_num_seqs rows), KV written in place, and the hidden state of each request's last
  token gathered on the device;
- the sampling tail, per request bucket R: logits of those rows and greedy argmax.

The core's ModelRunner still computes logits and samples on the host from what `forward`
returns (it has no hook to take token ids from a step runner yet), so `forward` returns a
host tensor [t, hidden] holding each request's last row (the only rows the runner reads;
other rows are zero), and keeps the device's greedy ids in `last_greedy`.
"""

from __future__ import annotations

import copy
import logging
import time

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from paged.model.attention import AttentionMetadata
from paged.worker.step_runner import StepRunner, copy_kv_blocks
from paged_tpu.attention import unpack
from paged_tpu.buckets import Buckets, Layout, dummy_step, pack_step, pad_to

log = logging.getLogger("paged")


def replicate(model: nn.Module, device: torch.device, keep: list[object]) -> nn.Module:
    """A copy of `model` on `device`, without a host copy of its weights on the way; the
    objects in `keep` (the attention backend) are shared, KV caches are left behind."""
    memo: dict[int, object] = {id(o): o for o in keep}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(p.detach().to(device), requires_grad=False)
    for m in model.modules():
        cache = getattr(m, "kv_cache", None)
        if cache is not None:
            memo[id(cache)] = None
    replica = copy.deepcopy(model, memo)
    replica.to(device)  # buffers
    for m in replica.modules():  # plain tensor attributes (the rotary cache)
        for name, value in list(vars(m).items()):
            if isinstance(value, torch.Tensor) and value.device != device:
                setattr(m, name, value.to(device))
    return replica


class XlaStepRunner(StepRunner):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        import torch_xla

        self.xla = torch_xla
        self.device = torch_xla.device()
        self.buckets = Buckets.from_config(self.config)
        self.xla_model = replicate(self.model, self.device, [self.backend])
        # The host model now only serves the runner's compute_logits: drop its decoder weights.
        for p in self.model.layers.parameters():
            p.data = torch.empty(0, dtype=p.dtype)
        self.kv_bound = False
        self.device_sampling = True  # run the greedy tail (ids in last_greedy)
        self.last_greedy: list[int] = []

    # ---- start-up ---------------------------------------------------------------------
    def bind_kv_caches(self) -> None:
        """Move the caches the runner allocated on the host to the device (freeing the host
        copies) and bind them to the device model's layers."""
        for host, dev in zip(self.model.layers, self.xla_model.layers):
            cache = host.self_attn.kv_cache
            with torch.inference_mode(False):
                dev.self_attn.kv_cache = cache.to(self.device, copy=True)
            host.self_attn.kv_cache = None
            cache.set_()  # the runner's list still holds it: release the storage
        self.kv_bound = True

    def copy_blocks(self, copies: torch.Tensor) -> None:
        """Copy-on-write of shared KV blocks, in the device model's caches."""
        if not self.kv_bound:
            self.bind_kv_caches()
        copy_kv_blocks(self.xla_model, self.backend, copies.to(self.device))

    def capture(self) -> None:
        """Compile the forward for every token bucket and the tail for every request bucket."""
        self.bind_kv_caches()
        if self.config.enforce_eager:  # still bucketed: each program compiles on first use
            return
        b = self.buckets
        t0 = time.perf_counter()
        with tqdm(total=b.count, desc="Compiling XLA programs", leave=False) as bar:
            for tokens in b.tokens:
                last = self._forward_program(dummy_step(self._layout(tokens)), tokens)
                bar.update()
            for reqs in b.reqs:
                self._tail_program(last, reqs)
                bar.update()
        log.info(
            "compiled %d XLA programs (tokens %s, requests %s) in %.1f s",
            b.count,
            b.tokens,
            b.reqs,
            time.perf_counter() - t0,
        )

    def _layout(self, tokens: int) -> Layout:
        return Layout(tokens, self.buckets.max_reqs, self.buckets.max_blocks)

    # ---- one step ---------------------------------------------------------------------
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        if not self.kv_bound:
            self.bind_kv_caches()
        t, b = meta.num_tokens, meta.num_reqs
        tokens = pad_to(t, self.buckets.tokens)
        qsl = meta.query_start_loc.cpu().numpy()
        buf = pack_step(
            self._layout(tokens),
            input_ids.cpu().numpy(),
            positions.cpu().numpy(),
            meta.slot_mapping.cpu().numpy(),
            qsl,
            meta.seq_lens.cpu().numpy(),
            meta.block_tables.cpu().numpy(),
        )
        last = self._forward_program(buf, tokens)
        if self.device_sampling:
            ids = self._tail_program(last, pad_to(b, self.buckets.reqs))
            self.last_greedy = ids[:b].tolist()
        rows = last.cpu()[:b]  # device data after the sync: a transfer, no program
        hidden = torch.zeros(t, rows.shape[1], dtype=rows.dtype)
        hidden[torch.from_numpy(qsl[1 : b + 1].astype(np.int64) - 1)] = rows
        return hidden

    def _forward_program(self, buf: np.ndarray, tokens: int) -> torch.Tensor:
        """Run (compiling on first sight) the forward of one token bucket: [max_reqs, H]."""
        # XLA tensors cannot be inference tensors: plain no_grad, even inside the runner's
        # inference_mode.
        with torch.inference_mode(False), torch.no_grad():
            dev = torch.from_numpy(buf).to(self.device)
            last = self._trace_forward(dev, self._layout(tokens))
            self.xla.sync()  # executes; intermediates are gone, so only KV and `last` are outputs
        return last

    def _trace_forward(self, buf: torch.Tensor, layout: Layout) -> torch.Tensor:
        input_ids, positions, meta, last_rows = unpack(buf, layout, self.config.block_size)
        hidden = self.xla_model(input_ids, positions, self.backend.plan(meta))
        return hidden.index_select(0, last_rows)

    def _tail_program(self, last: torch.Tensor, reqs: int) -> torch.Tensor:
        """Greedy ids of the first `reqs` rows, on the device (one program per bucket)."""
        with torch.inference_mode(False), torch.no_grad():
            ids = self.xla_model.compute_logits(last[:reqs]).argmax(dim=-1)
            self.xla.sync()
            return ids.cpu()
