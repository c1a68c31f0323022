"""Model architectures by HF ``architectures`` name, built-ins and plugins' alike."""

from __future__ import annotations

from paged.plugins import extra_models


def model_class(hf_config) -> type:
    models = extra_models()
    archs = getattr(hf_config, "architectures", None) or []
    for arch in archs:
        if arch in models:
            return models[arch]
    raise ValueError(
        f"unsupported model architecture {archs or '(none given)'}; "
        f"supported: {', '.join(sorted(models))}"
    )
