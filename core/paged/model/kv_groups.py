"""KV-cache groups: a model's layers grouped by sliding window, as vLLM's hybrid KV cache
manager. Every group has the same number of layers and its own block table; the i-th layer
of every group shares one cache tensor, so one block id costs a group's layers, not the
model's, and a windowed group releases the blocks that fall out of its window while a global
group keeps them (docs/architecture.md, KV cache)."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch.nn as nn

from paged.model.kv_window import kv_window, window_blocks_needed

log = logging.getLogger("paged")
# More groups cost more host work per step (a block table each): beyond this many, every
# layer keeps every block instead.
MAX_KV_GROUPS = 16


@dataclass(frozen=True)
class KVGroups:
    windows: tuple[int | None, ...]  # per group: its layers' window (None: global attention)
    layers: tuple[tuple[int, ...], ...]  # per group: its layers (the model's numbering)

    def __len__(self) -> int:
        return len(self.windows)

    @property
    def size(self) -> int:
        """Layers per group: the cache tensors of the whole model."""
        return len(self.layers[0])

    def place(self, layer: int) -> tuple[int, int]:
        """(group, cache tensor) of `layer`: the tensor is its position within its group."""
        for g, members in enumerate(self.layers):
            if layer in members:
                return g, members.index(layer)
        raise KeyError(f"layer {layer} is in no KV-cache group")

    def blocks_needed(self, max_model_len: int, block_size: int, max_chunk: int) -> int:
        """Blocks one request of max_model_len needs at most: every group's, the null block."""
        full = -(-max_model_len // block_size)
        total = 0
        for w in self.windows:  # a windowed group: bounded by its window (null block aside)
            bounded = window_blocks_needed(w, block_size, max_chunk) - 1 if w else full
            total += min(full, bounded)
        return total + any(w is not None for w in self.windows)


def one_group(
    hf_config, layers: Sequence[nn.Module], max_model_len: int, start_layer: int = 0
) -> KVGroups:
    """Every layer in one group (the window when every layer is windowed, else None)."""
    window = kv_window(hf_config, layers, max_model_len)
    count = getattr(hf_config, "num_hidden_layers", None) or start_layer + len(layers)
    return KVGroups((window,), (tuple(range(count)),))


def kv_groups(
    hf_config, layers: Sequence[nn.Module], max_model_len: int, start_layer: int = 0
) -> KVGroups:
    """The groups of a model whose `layers` (this pipeline stage's, the first numbered
    `start_layer`) mix windows: by window (global first), `gcd` of the counts each. One group
    when all layers share a window, when the config and the built layers disagree, when a
    layer's attention cannot pick its group's metadata (no `kv_group`), or past MAX_KV_GROUPS."""
    from paged.model.llama import sliding_window

    single = one_group(hf_config, layers, max_model_len, start_layer)
    count = getattr(hf_config, "num_hidden_layers", None)
    if not count or not layers:
        return single
    windows = [sliding_window(hf_config, i, max_model_len) for i in range(count)]
    if len(set(windows)) == 1:
        return single
    attns = [getattr(layer, "self_attn", None) for layer in layers]
    applied = [getattr(a, "attn_opts", {}).get("window") for a in attns]
    if applied != windows[start_layer : start_layer + len(layers)]:
        return single  # a plugin model reading the config its own way
    if not all(hasattr(a, "kv_group") for a in attns):
        log.info("KV cache: the model's attention takes no kv_group: every layer keeps every block")
        return single
    by_window: dict[int | None, list[int]] = {}
    for w in sorted(set(windows), key=lambda w: (w is not None, w or 0)):
        by_window[w] = [i for i in range(count) if windows[i] == w]
    size = math.gcd(*(len(idx) for idx in by_window.values()))
    if count // size > MAX_KV_GROUPS:
        log.info(
            "KV cache: layers by window %s do not split into %d groups or fewer of equal size: "
            "every layer keeps every block",
            {w: len(idx) for w, idx in by_window.items()},
            MAX_KV_GROUPS,
        )
        return single
    groups = [(w, tuple(idx[k : k + size])) for w, idx in by_window.items()
              for k in range(0, len(idx), size)]  # fmt: skip
    log.info("KV cache: %d groups of %d layers, windows %s", len(groups), size,
             [w for w, _ in groups])  # fmt: skip
    return KVGroups(tuple(w for w, _ in groups), tuple(m for _, m in groups))
