"""How a checkpoint is run for pooling (embeddings), as vLLM decides it.

`--runner auto` runs a model for pooling when its architecture is a bare decoder (`*Model`,
e.g. Qwen3Model), when its checkpoint has no LM head, or when it is a sentence-transformers
embedding model (`modules.json`); otherwise for generation. The pooler's defaults are LAST
with normalisation (vLLM's for embeddings), replaced by the sentence-transformers files
(`1_Pooling/config.json`'s pooling mode, a `Normalize` module), then by `--pooler-config`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paged.pooling_params import POOLING_TYPES

log = logging.getLogger("paged")

RUNNERS = ("auto", "generate", "pooling")
_ST_MODES = {  # sentence-transformers' Pooling config -> our pooling type
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
}
_ST_UNSUPPORTED = (
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
)
_POOLER_KEYS = ("pooling_type", "normalize")


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str = "LAST"
    normalize: bool = True
    hidden_size: int = 0
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None


def parse_pooler_config(value: str | dict | None) -> dict[str, Any]:
    """`--pooler-config` ('{"pooling_type": "MEAN", "normalize": false}'), checked."""
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"pooler_config: not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError("pooler_config: must be a JSON object")
    unknown = sorted(set(value) - set(_POOLER_KEYS))
    if unknown:
        raise ValueError(
            f"pooler_config: unsupported key(s) {', '.join(unknown)} "
            f"(supported: {', '.join(_POOLER_KEYS)})"
        )
    out = dict(value)
    if "pooling_type" in out:
        kind = str(out["pooling_type"]).upper()
        if kind not in POOLING_TYPES:
            raise ValueError(
                f"pooler_config.pooling_type: must be one of {', '.join(POOLING_TYPES)}"
            )
        out["pooling_type"] = kind
    if "normalize" in out and not isinstance(out["normalize"], bool):
        raise ValueError("pooler_config.normalize: must be true or false")
    return out


def sentence_transformers_pooling(path: str | None) -> dict[str, Any] | None:
    """{pooling_type, normalize} from a sentence-transformers model's files, or None when
    the directory is not one (no modules.json with a Pooling module)."""
    if path is None or not Path(path).is_dir():
        return None
    root = Path(path)
    try:
        modules = json.loads((root / "modules.json").read_text())
    except (OSError, ValueError):
        return None
    kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
    if "Pooling" not in kinds:
        return None
    for kind in kinds:
        if kind not in ("Transformer", "Pooling", "Normalize"):
            raise ValueError(
                f"sentence-transformers module {kind} (modules.json) is not supported: paged "
                "pools the decoder's hidden states, with optional normalisation only"
            )
    try:
        pool = json.loads((root / kinds["Pooling"].get("path", "") / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the sentence-transformers Pooling config: {e}") from None
    bad = [k for k in _ST_UNSUPPORTED if pool.get(k)]
    modes = [t for k, t in _ST_MODES.items() if pool.get(k)]
    if bad or len(modes) != 1:
        raise ValueError(
            "sentence-transformers pooling: exactly one of pooling_mode_lasttoken, "
            f"pooling_mode_mean_tokens, pooling_mode_cls_token is supported (got "
            f"{', '.join(bad + [k for k in _ST_MODES if pool.get(k)]) or 'none'})"
        )
    if pool.get("include_prompt") is False:
        raise ValueError(
            "sentence-transformers pooling: include_prompt false (pooling without the "
            "instruction's tokens) is not supported"
        )
    return {"pooling_type": modes[0], "normalize": "Normalize" in kinds}


def _has_lm_head(hf_config, src) -> bool:
    """Whether the checkpoint can produce logits: tied embeddings, or an lm_head tensor."""
    if getattr(hf_config, "tie_word_embeddings", False) or src is None or src.kind != "hf":
        return True  # GGUF and dummy shapes: the head is part of the model's layout
    from safetensors import safe_open

    from paged.model.hf_loader import safetensors_files

    for f in safetensors_files(src.path):
        with safe_open(f, framework="pt") as handle:
            if any(k.endswith("lm_head.weight") for k in handle.keys()):  # noqa: SIM118
                return True
    return False


def resolve_runner(runner: str, hf_config, src) -> str:
    """`generate` or `pooling` for `--runner` (auto: see the module's docstring)."""
    if runner not in RUNNERS:
        raise ValueError(f"runner: must be one of {', '.join(RUNNERS)}")
    if runner != "auto":
        return runner
    archs = getattr(hf_config, "architectures", None) or []
    if any(a.endswith("Model") for a in archs):
        return "pooling"
    if sentence_transformers_pooling(getattr(src, "path", None)) is not None:
        return "pooling"
    return "generate" if _has_lm_head(hf_config, src) else "pooling"


def resolve_pooler(pooler_config: str | dict | None, hf_config, src) -> PoolerConfig:
    """The model's pooler: defaults, the sentence-transformers files, then --pooler-config."""
    settings: dict[str, Any] = {"pooling_type": "LAST", "normalize": True}
    settings |= sentence_transformers_pooling(getattr(src, "path", None)) or {}
    settings |= parse_pooler_config(pooler_config)
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    return PoolerConfig(
        settings["pooling_type"],
        settings["normalize"],
        hf_config.hidden_size,
        bool(getattr(hf_config, "is_matryoshka", False) or dims),
        tuple(dims) if dims else None,
    )
