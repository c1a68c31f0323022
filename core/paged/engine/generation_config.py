"""Sampling defaults from a generation_config.json (--generation-config), applied as vLLM
applies them: a request's sampling field left unset takes the model's value; a field the
request sets is its own.

`auto` reads the model's generation_config.json (none: no defaults), `vllm` reads nothing,
a folder path reads that folder's. --override-generation-config's keys apply over either.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from paged.sampling.params import SamplingParams

# generation_config.json key -> SamplingParams field (vLLM's set: other keys are not sampling)
KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def _sampling(values: dict[str, Any], field: str) -> dict[str, Any]:
    """{SamplingParams field: value} of a generation config's sampling keys, checked."""
    out = {KEYS[k]: v for k, v in values.items() if k in KEYS and v is not None}
    try:
        SamplingParams(**out)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{field}: {e}") from None
    return out


def check_generation_flags(setting: str, override: dict[str, Any] | None) -> None:
    """ValueError for a bad --generation-config or --override-generation-config."""
    if setting not in ("auto", "vllm") and not os.path.isdir(os.path.expanduser(setting)):
        raise ValueError(
            f"generation_config: {setting[:200]!r} is not auto, vllm or a folder holding a "
            "generation_config.json"
        )
    unknown = sorted(set(override or {}) - set(KEYS))
    if unknown:
        raise ValueError(
            f"override_generation_config: {', '.join(unknown)}: not a sampling key paged "
            f"applies ({', '.join(KEYS)})"
        )
    _sampling(override or {}, "override_generation_config")


def _read(folder: str, required: bool) -> dict[str, Any]:
    from transformers import GenerationConfig

    if not os.path.isfile(os.path.join(folder, "generation_config.json")):
        if required:
            raise ValueError(f"generation_config: no generation_config.json in {folder!r}")
        return {}
    try:  # transformers' reading of the file (to_diff_dict: the keys that were set)
        return GenerationConfig.from_pretrained(folder).to_diff_dict()
    except Exception as e:
        raise ValueError(f"generation_config: cannot read {folder!r}: {e}") from None


def generation_defaults(
    setting: str, model_path: str | None, override: dict[str, Any] | None = None
) -> dict[str, Any]:
    """{SamplingParams field: default} for requests that leave the field unset.

    model_path: the model's directory or .gguf file (None: a dummy named shape)."""
    values: dict[str, Any] = {}
    if setting == "auto":
        if model_path:
            folder = model_path if os.path.isdir(model_path) else os.path.dirname(model_path)
            values = _read(folder, required=False)
    elif setting != "vllm":
        values = _read(os.path.expanduser(setting), required=True)
    values = {**values, **(override or {})}
    return _sampling(values, "generation_config")


def apply_defaults(
    params: SamplingParams, defaults: dict[str, Any], unset: set[str]
) -> SamplingParams:
    """params with defaults[f] for each field f in `unset` (the fields the request left unset;
    max_tokens is fitted to the prompt by the caller)."""
    change = {k: v for k, v in defaults.items() if k in unset and k != "max_tokens"}
    return dataclasses.replace(params, **change) if change else params
