"""The server's LoRA adapters by name: --lora-modules at start, /v1/load_lora_adapter and
/v1/unload_lora_adapter at run time. A request selects one by its `model` field.

Each load gets a new integer id (so an unloaded name loaded again from another directory is
never mistaken for the old adapter by the engine's slots or prefix cache). The adapter's
files are read and checked here (config, tensor names, rank, layers and hidden size against
the model's config), off the event loop; the engine checks every shape against the model when
a request first uses it (a mismatch is a 400 on that request, naming `model`). Requests carry
the adapter's path, so every replica can load it on its own.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from contextvars import ContextVar
from typing import Any

from paged.lora.peft import AdapterError, check_fits, read_spec
from paged.lora.request import LoRARequest
from paged.server.errors import APIError

# The adapter the current request's `model` field named (set by Serving.check_model, read by
# Serving.fit into the request's Prompt, within the same handler).
CURRENT: ContextVar[LoRARequest | None] = ContextVar("paged_lora", default=None)


class LoRAAdapters:
    def __init__(
        self, enabled: bool = False, max_rank: int = 16, model_shape: tuple[int, int] | None = None
    ) -> None:
        self.enabled = enabled
        self.max_rank = max_rank
        self.model_shape = model_shape  # (hidden size, layers) of the model, where known
        self.by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def get(self, name: str | None) -> LoRARequest | None:
        return self.by_name.get(name) if name else None

    def check_new(self, name: str, base_names: Sequence[str]) -> None:
        """APIError unless `name` can be given to a new adapter."""
        if not self.enabled:
            raise APIError(400, "lora_name: LoRA adapters need --enable-lora", "lora_name")
        if not name:
            raise APIError(400, "lora_name: must not be empty", "lora_name")
        if name in base_names:
            raise APIError(400, f"lora_name: {name!r} is the base model's name", "lora_name")
        if name in self.by_name:
            msg = f"lora_name: the LoRA adapter {name!r} has already been loaded"
            raise APIError(400, msg, "lora_name")

    def load(
        self, name: str, path: str, base_names: Sequence[str], parent: str | None = None
    ) -> LoRARequest:
        """Read and check the adapter at `path` (blocking: call it off the event loop) and
        register it as `name` (its /v1/models parent: `parent`, else the base model's first
        name); APIError 400 naming the field otherwise."""
        self.check_new(name, base_names)
        try:
            spec = read_spec(path, self.max_rank)
            if self.model_shape is not None:
                check_fits(spec, *self.model_shape)
        except AdapterError as e:
            raise APIError(400, str(e) if str(e).startswith("lora_path") else f"lora_path: {e}",
                           "lora_path") from None  # fmt: skip
        self.check_new(name, base_names)  # loaded by another request meanwhile
        lora = LoRARequest(name, next(self._ids), spec.path, parent or base_names[0])
        self.by_name[name] = lora
        return lora

    def unload(self, name: str) -> LoRARequest:
        if not self.enabled:
            raise APIError(400, "lora_name: LoRA adapters need --enable-lora", "lora_name")
        lora = self.by_name.pop(name, None)
        if lora is None:
            msg = f"lora_name: the LoRA adapter {name[:100]!r} cannot be found"
            raise APIError(404, msg, "lora_name", "model_not_found")
        return lora

    def cards(self, created: int) -> list[dict[str, Any]]:
        """/v1/models entries: one per adapter, its parent the base model."""
        return [
            {
                "id": lo.lora_name,
                "object": "model",
                "created": created,
                "owned_by": "paged",
                "root": lo.lora_path,
                "parent": lo.base_model_name,
            }  # fmt: skip
            for lo in self.by_name.values()
        ]
