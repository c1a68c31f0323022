"""Engine configuration: one dataclass is the single source of CLI flags and API kwargs."""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

import torch

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str | int | None) -> int | None:
    """'4GiB', '512M', '1073741824' -> bytes."""
    if text is None or isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([\d.]+)\s*([kmgt]?)(i?b)?\s*", str(text).lower())
    if not m:
        raise ValueError(f"invalid size {text!r}: use e.g. 4GiB, 512MiB or a byte count")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def _opt(help: str, **kw: Any) -> Any:
    default = kw.pop("default", None)
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class EngineConfig:
    model: str | None = _opt("HF model directory or .gguf file (default: SmolLM2-135M-Instruct)")
    tokenizer: str | None = _opt("tokenizer directory, if not the model's")
    dtype: str = _opt("float32 | bfloat16 | float16 | auto (the platform's choice)", default="auto")
    load_format: str = _opt("auto | safetensors | gguf | dummy (random weights)", default="auto")
    platform: str | None = _opt("force a platform (also PAGED_PLATFORM)")
    max_model_len: int | None = _opt("context length (default: the model's)", type=int)
    block_size: int = _opt("tokens per KV cache block", default=16, type=int)
    kv_cache_memory: int | None = _opt("KV cache size, e.g. 2GiB", type=parse_bytes)
    gpu_memory_utilization: float = _opt(
        "fraction of device memory for weights, activations and KV cache", default=0.9, type=float
    )
    num_kv_blocks: int | None = _opt("exact number of KV cache blocks (overrides sizes)", type=int)
    max_num_seqs: int = _opt("most requests in one step", default=256, type=int)
    max_num_batched_tokens: int = _opt("most tokens in one step", default=2048, type=int)
    enable_prefix_caching: bool = _opt("reuse KV blocks of shared prefixes", default=True)
    enforce_eager: bool = _opt("disable graph capture", default=False)
    async_scheduling: bool | None = _opt(
        "schedule and launch each step before the previous step's tokens reach the host, "
        "hiding host work behind the device (default: the platform's choice)"
    )
    seed: int = _opt("seed for weights of --load-format dummy and unseeded sampling", default=0)
    served_model_name: str | None = _opt("model name reported by the API")
    chat_template: str | None = _opt("a Jinja chat template file or string")

    def __post_init__(self) -> None:
        self.kv_cache_memory = parse_bytes(self.kv_cache_memory)
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}: float32, bfloat16, float16 or auto")
        return _DTYPES[self.dtype]

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, positional_model: bool = True) -> None:
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            help = f.metadata.get("help", "")
            if f.name == "model" and positional_model:
                parser.add_argument("model", nargs="?", default=None, help=help)
            elif f.type in ("bool", bool, "bool | None"):
                parser.add_argument(
                    flag, action=argparse.BooleanOptionalAction, default=f.default, help=help
                )
            else:
                parser.add_argument(
                    flag,
                    type=f.metadata.get("type", str),
                    default=f.default,
                    help=help,
                    dest=f.name,
                )

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})
