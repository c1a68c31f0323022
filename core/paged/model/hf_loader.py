"""Weights of a Hugging Face model directory: memory-mapped safetensors, one file or sharded."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from paged.model.loader import ModelLoadError, _show

_INDEX = "model.safetensors.index.json"
_PICKLES = ("*.bin", "*.pt", "*.pth", "*.ckpt")


def safetensors_files(path: str) -> list[str]:
    """The safetensors files holding the model's weights, in load order."""
    root = Path(path)
    index = root / _INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise ModelLoadError(f"unreadable {_INDEX} in {_show(path)}: {e}") from e
        files = [str(root / f) for f in sorted(set(weight_map.values()))]
        missing = [os.path.basename(f) for f in files if not os.path.isfile(f)]
        if missing:
            raise ModelLoadError(f"{_show(path)} lacks shards listed in {_INDEX}: {missing[:5]}")
        return files
    if (root / "model.safetensors").is_file():
        return [str(root / "model.safetensors")]
    files = sorted(str(p) for p in root.glob("*.safetensors"))
    if files:
        return files
    if any(any(root.glob(p)) for p in _PICKLES):
        raise ModelLoadError(
            f"{_show(path)} has only PyTorch pickle weights (.bin/.pt); paged loads safetensors "
            "only (pickles can run code). Convert them to *.safetensors first"
        )
    raise ModelLoadError(f"no *.safetensors weights in {_show(path)}")


def iter_safetensors(path: str, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open
    from tqdm.auto import tqdm

    files = safetensors_files(path)
    total = 0
    for f in files:  # headers only: cheap
        with safe_open(f, framework="pt") as handle:
            total += len(handle.keys())
    with tqdm(total=total, desc="Loading weights", unit="tensor", disable=not progress) as bar:
        for f in files:
            with safe_open(f, framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                    bar.update()
                    if name.endswith("rotary_emb.inv_freq"):  # a buffer old checkpoints save
                        continue
                    yield name, handle.get_tensor(name)
