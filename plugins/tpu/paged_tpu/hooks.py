"""Entry point of the TPU plugin (group ``paged``): nothing heavy at import."""

from __future__ import annotations

from paged.hookspecs import hookimpl


@hookimpl
def paged_platforms() -> list[type]:
    from paged_tpu.platform import TpuPlatform

    return [TpuPlatform]
