"""The sliding window the KV cache may rely on: blocks that fall out of it are released."""

from __future__ import annotations

from collections.abc import Iterable

import torch.nn as nn


def kv_window(hf_config, layers: Iterable[nn.Module], max_model_len: int) -> int | None:
    """The window (the largest) when every attention layer is windowed, as the config says
    (HF's sliding_window / layer_types) and as the built layers apply it (their attention
    options); None when any layer attends globally (Gemma 2/3, Qwen2 with max_window_layers:
    those get KV-cache groups, model/kv_groups.py) or when the two disagree (a plugin model
    reading the config its own way)."""
    from paged.model.llama import sliding_window

    count = getattr(hf_config, "num_hidden_layers", None)
    if not count:
        return None
    from_config = [sliding_window(hf_config, i, max_model_len) for i in range(count)]
    built = [getattr(getattr(layer, "self_attn", None), "attn_opts", {}) for layer in layers]
    applied = [opts.get("window") if isinstance(opts, dict) else None for opts in built]
    windows = from_config + applied
    if not applied or any(w is None for w in windows):
        return None
    return max(windows)


def window_blocks_needed(window: int, block_size: int, max_chunk: int) -> int:
    """Blocks one sequence holds at most with a window: the window before a chunk, the chunk
    itself, a step's lag before released blocks are registered in the prefix cache (one more
    chunk), a partial block at each end, and the null block."""
    return -(-(window - 1 + 2 * max_chunk) // block_size) + 3
