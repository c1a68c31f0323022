"""Model architectures by HF ``architectures`` name, built-ins and plugins' alike."""

from __future__ import annotations

from typing import Any

from paged.plugins import extra_models


def model_class(hf_config) -> type:
    models = extra_models()
    archs = getattr(hf_config, "architectures", None) or []
    for arch in archs:
        if arch in models:
            return models[arch]
    for arch in archs:  # a bare decoder (Qwen3Model: an embedding checkpoint) runs as its LM
        causal = arch.removesuffix("Model") + "ForCausalLM"
        if arch.endswith("Model") and causal in models:
            return models[causal]
    raise ValueError(
        f"unsupported model architecture {archs or '(none given)'}; "
        f"supported: {', '.join(sorted(models))}"
    )


def check_supported(hf_config, platform: Any) -> None:
    """Refuse, naming the architecture, a model that needs a feature (its class's `requires`)
    the platform lists in `unsupported_features`."""
    cls = model_class(hf_config)
    lacking = sorted(set(getattr(cls, "requires", ())) & set(platform.unsupported_features))
    if lacking:
        arch = hf_config.architectures[0]
        raise ValueError(
            f"model architecture {arch} cannot run on platform {platform.name}: it needs "
            f"{', '.join(lacking)}, which {platform.name} does not support"
        )
