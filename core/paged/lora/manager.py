"""The worker's LoRA state: the model's target linears wrapped (LoRALinear), a fixed number
of device slots (--max-loras) loaded on demand and evicted least recently used, a host cache
of adapter tensors (--max-cpu-loras, LRU), and each step's tokens grouped by slot.

The scheduler never puts more distinct adapters in one step than there are slots, so every
adapter of a step gets a slot; a slot is only reloaded when its adapter is not in the step.
The step's lists live in one static device buffer ([starts | token ids]), rewritten before
each forward: captured decode graphs read it in place (the CUDA-graph choice: LoRA runs
inside the graphs, no step falls back to eager because of it).

Under tensor parallelism each rank holds its shard of every adapter, cut like the base weights
(and a pipeline stage the layers it runs):
a column-parallel projection (qkv, gate_up) keeps A whole and this rank's rows of B; a
row-parallel one (o, down) this rank's columns of A and B whole, so its partial LoRA output
joins the layer's partial output before the all-reduce that sums them. Every rank runs
`prepare` with the same adapters and `forget` at the same point between steps (the driver
sends them with the step), so their slots agree.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from paged.lora import batch as step_batch
from paged.lora.layers import LoRALinear
from paged.lora.peft import AdapterError, AdapterSpec, check_shapes, load_tensors, read_spec
from paged.lora.request import LoRARequest

log = logging.getLogger("paged")

# HF projection -> (module path in our layer, its slice of that stacked module)
TARGET_SLICES = {
    "q_proj": ("self_attn.qkv_proj", 0),
    "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
}


FUSED_PATHS = {"qkv_proj": "self_attn.qkv_proj", "gate_up_proj": "mlp.gate_up_proj"}


@dataclass(frozen=True)
class Target:
    """A projection LoRA applies to: this rank's shard of the whole model's."""

    full_in: int  # the whole projection's input features
    full_outs: list[int]  # and output features per slice
    cols: tuple[int, int]  # this rank's input columns of the whole projection
    rows: list[tuple[int, int]]  # per slice: this rank's output rows of the whole slice

    @property
    def fin(self) -> int:
        """This rank's input features."""
        return self.cols[1] - self.cols[0]

    @property
    def outs(self) -> list[int]:
        """This rank's output features per slice."""
        return [r1 - r0 for r0, r1 in self.rows]


def _targets(layer: nn.Module, cfg) -> dict[str, Target]:
    """{module path: Target} of the layer's LoRA targets."""
    out: dict[str, Target] = {}
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    hidden = cfg.hidden_size
    whole = (0, hidden)
    if attn is not None and hasattr(attn, "qkv_proj") and hasattr(attn, "sizes"):
        sh, hd = attn.shard, attn.head_dim
        full_q, full_kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
        q_rows = (sh.q_start * hd, (sh.q_start + sh.q_count) * hd)
        kv_rows = (sh.kv_start * hd, (sh.kv_start + sh.kv_count) * hd)
        out["self_attn.qkv_proj"] = Target(hidden, [full_q, full_kv, full_kv], whole,
                                           [q_rows, kv_rows, kv_rows])  # fmt: skip
        if hasattr(attn, "o_proj"):
            out["self_attn.o_proj"] = Target(full_q, [hidden], q_rows, [whole])
    if mlp is not None and hasattr(mlp, "gate_up_proj") and hasattr(mlp, "inter_end"):
        s, e = mlp.inter_start, mlp.inter_end
        full = cfg.intermediate_size
        out["mlp.gate_up_proj"] = Target(hidden, [full, full], whole, [(s, e), (s, e)])
        if hasattr(mlp, "down_proj"):
            out["mlp.down_proj"] = Target(full, [hidden], (s, e), [whole])
    return out


def shard(t: Target, a: torch.Tensor, b: torch.Tensor, j: int) -> tuple[torch.Tensor, ...]:
    """This rank's (A [r, fin], B [out_j, r]) of slice j's whole (A [r, full_in], B)."""
    (c0, c1), (r0, r1) = t.cols, t.rows[j]
    return a[:, c0:c1], b[r0:r1]


class LoRAManager:
    def __init__(
        self,
        model: nn.Module,
        config,
        hf_config,
        max_tokens: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.max_loras = config.max_loras
        self.rank = config.max_lora_rank
        self.max_cpu_loras = config.max_cpu_loras or config.max_loras
        self.device = device
        s = self.max_loras
        size = step_batch.buffer_size(s, max_tokens)
        self.buf = torch.zeros(size, dtype=torch.int64, device=device)
        self.batch = step_batch.LoRABatch.on(self.buf, s)
        self.layers: list[dict[str, LoRALinear]] = []
        self.targets = [_targets(layer, hf_config) for layer in model.layers]
        common = set.intersection(*(set(t) for t in self.targets)) if self.targets else set()
        for layer, targets in zip(model.layers, self.targets):
            wrapped = {}
            for path in sorted(common):
                parent_name, _, attr = path.rpartition(".")
                parent = layer.get_submodule(parent_name)
                t = targets[path]
                mod = LoRALinear(getattr(parent, attr), t.fin, t.outs, s, self.rank, self.batch,
                                 dtype, device)  # fmt: skip
                setattr(parent, attr, mod)
                wrapped[path] = mod
            self.layers.append(wrapped)
        # {HF module: (in, out)} of the whole (unsharded) model, for checking adapters
        first = self.targets[0] if self.targets else {}
        self.expected = {
            name: (first[path].full_in, first[path].full_outs[j])
            for name, (path, j) in TARGET_SLICES.items()
            if path in common
        }
        for name, path in FUSED_PATHS.items():  # a LoRA over the whole stacked output
            if path in common:
                self.expected[name] = (first[path].full_in, sum(first[path].full_outs))
        self.num_layers = hf_config.num_hidden_layers
        self.first_layer = getattr(model, "start_layer", 0)  # this pipeline stage's first
        self.specs: dict[int, AdapterSpec] = {}  # checked adapters by id
        self.host: OrderedDict[int, dict] = OrderedDict()  # host tensors, LRU
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, LRU first
        self.free_slots = list(range(s))
        self.loads = 0  # adapters loaded into a slot (for tests and logs)
        self.forgotten: list[int] = []  # ids forgotten since the last step (for other ranks)

    # ---- adapters ---------------------------------------------------------------------
    def check(self, lora: LoRARequest) -> AdapterSpec:
        """The adapter's spec, read and checked against the model once per id; AdapterError
        (a ValueError naming the problem) for one that cannot run here."""
        spec = self.specs.get(lora.lora_int_id)
        if spec is not None:
            if read_path(lora.lora_path) != spec.path:
                raise AdapterError(
                    f"lora_int_id {lora.lora_int_id} is already used by the adapter at "
                    f"{spec.path!r}; give {lora.lora_path!r} an id of its own"
                )
            return spec
        spec = read_spec(lora.lora_path, self.rank)
        check_shapes(spec, self.expected, self.num_layers)
        self.specs[lora.lora_int_id] = spec
        return spec

    def forget(self, lora_int_id: int) -> None:
        """Drop an adapter (unloaded): its slot and host copy are freed."""
        self.forgotten.append(lora_int_id)
        self.specs.pop(lora_int_id, None)
        self.host.pop(lora_int_id, None)
        slot = self.slot_of.pop(lora_int_id, None)
        if slot is not None:
            self.free_slots.append(slot)

    def _host_tensors(self, lora: LoRARequest) -> dict:
        lid = lora.lora_int_id
        if lid in self.host:
            self.host.move_to_end(lid)
            return self.host[lid]
        tensors = load_tensors(self.check(lora))
        self.host[lid] = tensors
        while len(self.host) > self.max_cpu_loras:
            self.host.popitem(last=False)
        return tensors

    def _ensure_slot(self, lora: LoRARequest, keep: set[int]) -> int:
        """The slot holding `lora`, loading it (evicting the least recently used adapter not
        in `keep`, this step's) when it is not on the device."""
        lid = lora.lora_int_id
        if lid in self.slot_of:
            self.slot_of.move_to_end(lid)
            return self.slot_of[lid]
        tensors = self._host_tensors(lora)  # first: a failed read leaves the slots as they were
        if self.free_slots:
            slot = self.free_slots.pop(0)
        else:
            victim = next(i for i in self.slot_of if i not in keep)
            slot = self.slot_of.pop(victim)
        for i, wrapped in enumerate(self.layers):
            layer = self.first_layer + i  # the adapter's layer index (pipeline stages)
            for path, mod in wrapped.items():
                t = self.targets[i][path]
                slices = {
                    j: shard(t, *tensors[(layer, name)], j)
                    for name, (p, j) in TARGET_SLICES.items()
                    if p == path and (layer, name) in tensors
                }
                for name, p in FUSED_PATHS.items():  # its A for every slice, B split
                    if p == path and (layer, name) in tensors:
                        a, b = tensors[(layer, name)]
                        slices = {j: shard(t, a, bj, j)
                                  for j, bj in enumerate(b.split(t.full_outs))}  # fmt: skip
                mod.set_slot(slot, slices)
        self.slot_of[lid] = slot
        self.loads += 1
        log.info("LoRA adapter %r (id %d) loaded into slot %d", lora.lora_name, lid, slot)
        return slot

    # ---- one step ---------------------------------------------------------------------
    def prepare(self, loras: list[LoRARequest | None], num_new: list[int]) -> None:
        """Load the step's adapters (one per request, None: the base model) into slots and
        write its tokens grouped by slot."""
        self.forgotten.clear()
        keep = {lo.lora_int_id for lo in loras if lo is not None}
        if len(keep) > self.max_loras:
            raise RuntimeError(f"{len(keep)} adapters in one step, {self.max_loras} slots")
        s = self.max_loras
        req_slot = np.array(
            [-1 if lo is None else self._ensure_slot(lo, keep) for lo in loras], dtype=np.int64
        )
        token_slot = np.repeat(req_slot, np.asarray(num_new, dtype=np.int64))
        host, starts = step_batch.pack(token_slot, s)
        self.buf[: len(host)].copy_(torch.from_numpy(host), non_blocking=True)
        self.batch.starts_host = starts
        self.batch.empty = not keep


def read_path(path: str) -> str:
    return os.path.abspath(os.path.expanduser(path))
