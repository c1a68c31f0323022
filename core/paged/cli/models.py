"""``paged models``: the model architectures paged runs (built-in and plugins'), with the
load formats each can come in. docs/models.md says which checkpoints each was tested on."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass


@dataclass
class ModelRow:
    architecture: str  # the HF config's `architectures` entry
    model_class: str  # module.Class that runs it
    provider: str  # "paged" (built in) or the plugin's distribution
    load_formats: list[str]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "models", help="list the model architectures paged runs and their load formats"
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def model_rows() -> list[ModelRow]:
    """One row per architecture, in the registry's precedence (a later plugin overrides)."""
    from paged.model.gguf_loader import ARCHS, MOE_ARCHS
    from paged.plugins import _hook_results

    gguf = {arch for _, arch in (*ARCHS.values(), *MOE_ARCHS.values())}
    rows: dict[str, ModelRow] = {}
    for dist, group in _hook_results("paged_models"):
        for arch, cls in (group or {}).items():
            formats = ["safetensors", *(["gguf"] if arch in gguf else []), "dummy"]
            name = f"{cls.__module__}.{cls.__qualname__}"
            provider = "paged" if cls.__module__.startswith("paged.") else dist
            rows[arch] = ModelRow(arch, name, provider, formats)
    return sorted(rows.values(), key=lambda r: r.architecture)


def run(args: argparse.Namespace) -> int:
    rows = model_rows()
    if args.json:
        print(json.dumps({"models": [asdict(r) for r in rows]}, indent=2))
        return 0
    header = ("ARCHITECTURE", "LOAD FORMATS", "FROM", "CLASS")
    table = [(r.architecture, ",".join(r.load_formats), r.provider, r.model_class) for r in rows]
    widths = [max(len(h), *(len(t[i]) for t in table)) for i, h in enumerate(header)]
    for line in (header, *table):
        print("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip())
    print("\nauto picks safetensors for a directory or Hub id, gguf for a .gguf file or GGUF repo;")
    print("dummy needs only the config. Tested checkpoints: docs/models.md")
    return 0
