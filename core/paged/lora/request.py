"""LoRARequest: which adapter a request runs with (vLLM's `vllm.lora.request.LoRARequest`).

A msgspec Struct so that it travels in the engine's wire messages as it is. The integer id
identifies the adapter everywhere (device slots, host cache, prefix-cache hashes): two
requests with the same id must name the same adapter files.
"""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1, got {self.lora_int_id}")
        if not self.lora_path:
            raise ValueError("lora_path: the adapter's directory is required")

    # vLLM's aliases
    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


def parse_lora_modules(items) -> list[dict[str, str]]:
    """--lora-modules: `name=path` strings, vLLM's JSON objects ({"name", "path",
    "base_model_name"}) or dicts -> [{"name", "path"[, "base_model_name"]}], names unique."""
    import json

    out: list[dict[str, str]] = []
    for item in items or []:
        if isinstance(item, str) and item.lstrip().startswith("{"):
            try:
                item = json.loads(item)
            except json.JSONDecodeError as e:
                raise ValueError(f"lora_modules: invalid JSON {item[:100]!r}: {e}") from None
        if isinstance(item, dict):
            unknown = set(item) - {"name", "path", "base_model_name"}
            if unknown or not item.get("name") or not item.get("path"):
                raise ValueError(
                    f'lora_modules: {item!r}: expected {{"name": ..., "path": ...}}'
                    + (f" (unknown keys {sorted(unknown)})" if unknown else "")
                )
            name, path = str(item["name"]), str(item["path"])
        elif isinstance(item, str) and "=" in item:
            name, path = item.split("=", 1)
        else:
            raise ValueError(f"lora_modules: {item!r}: expected name=path or a JSON object")
        if not name or not path:
            raise ValueError(f"lora_modules: {item!r}: both a name and a path are needed")
        if any(m["name"] == name for m in out):
            raise ValueError(f"lora_modules: the name {name!r} is given twice")
        entry = {"name": name, "path": path}
        if isinstance(item, dict) and item.get("base_model_name"):  # /v1/models' parent
            entry["base_model_name"] = str(item["base_model_name"])
        out.append(entry)
    return out
