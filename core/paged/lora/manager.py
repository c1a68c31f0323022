"""The worker's LoRA state: the model's target linears wrapped (LoRALinear), a fixed number
of device slots (--max-loras) loaded on demand and evicted least recently used, a host cache
of adapter tensors (--max-cpu-loras, LRU), and each step's tokens grouped by slot.

The scheduler never puts more distinct adapters in one step than there are slots, so every
adapter of a step gets a slot; a slot is only reloaded when its adapter is not in the step.
The step's lists live in one static device buffer ([starts | token ids]), rewritten before
each forward: captured decode graphs read it in place (the CUDA-graph choice: LoRA runs
inside the graphs, no step falls back to eager because of it).
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict

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


def _shapes(layer: nn.Module, cfg) -> dict[str, tuple[int, list[int]]]:
    """{module path: (in features, [out features per slice])} of the layer's LoRA targets."""
    out: dict[str, tuple[int, list[int]]] = {}
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    hidden = cfg.hidden_size
    if attn is not None and hasattr(attn, "qkv_proj") and hasattr(attn, "sizes"):
        out["self_attn.qkv_proj"] = (hidden, list(attn.sizes))
        if hasattr(attn, "o_proj"):
            out["self_attn.o_proj"] = (attn.sizes[0], [hidden])
    if mlp is not None and hasattr(mlp, "gate_up_proj") and hasattr(mlp, "inter_end"):
        inter = mlp.inter_end - mlp.inter_start
        out["mlp.gate_up_proj"] = (hidden, [inter, inter])
        if hasattr(mlp, "down_proj"):
            out["mlp.down_proj"] = (inter, [hidden])
    return out


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
        shapes = [_shapes(layer, hf_config) for layer in model.layers]
        common = set.intersection(*(set(sh) for sh in shapes)) if shapes else set()
        for layer, sh in zip(model.layers, shapes):
            wrapped = {}
            for path in sorted(common):
                parent_name, _, attr = path.rpartition(".")
                parent = layer.get_submodule(parent_name)
                fin, outs = sh[path]
                mod = LoRALinear(getattr(parent, attr), fin, outs, s, self.rank, self.batch,
                                 dtype, device)  # fmt: skip
                setattr(parent, attr, mod)
                wrapped[path] = mod
            self.layers.append(wrapped)
        # {HF module: (in, out)} of the whole model, for checking adapters (TP=1 only)
        first = shapes[0] if shapes else {}
        self.expected = {
            name: (first[path][0], first[path][1][j])
            for name, (path, j) in TARGET_SLICES.items()
            if path in common
        }
        for name, path in FUSED_PATHS.items():  # a LoRA over the whole stacked output
            if path in common:
                self.expected[name] = (first[path][0], sum(first[path][1]))
        self.num_layers = hf_config.num_hidden_layers
        self.specs: dict[int, AdapterSpec] = {}  # checked adapters by id
        self.host: OrderedDict[int, dict] = OrderedDict()  # host tensors, LRU
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, LRU first
        self.free_slots = list(range(s))
        self.loads = 0  # adapters loaded into a slot (for tests and logs)

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
            for path, mod in wrapped.items():
                slices = {
                    j: tensors[(i, name)]
                    for name, (p, j) in TARGET_SLICES.items()
                    if p == path and (i, name) in tensors
                }
                for name, p in FUSED_PATHS.items():  # its A for every slice, B split
                    if p == path and (i, name) in tensors:
                        a, b = tensors[(i, name)]
                        slices = dict(enumerate((a, bj) for bj in b.split(mod.out_sizes)))
                mod.set_slot(slot, slices)
        self.slot_of[lid] = slot
        self.loads += 1
        log.info("LoRA adapter %r (id %d) loaded into slot %d", lora.lora_name, lid, slot)
        return slot

    # ---- one step ---------------------------------------------------------------------
    def prepare(self, reqs: list, num_new: list[int]) -> None:
        """Load the step's adapters into slots and write its tokens grouped by slot."""
        loras = [getattr(r, "lora_request", None) for r in reqs]
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
