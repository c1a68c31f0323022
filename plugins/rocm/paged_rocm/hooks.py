"""Entry point of the ROCm plugin (group ``paged``): nothing heavy at import."""

from __future__ import annotations

from paged.hookspecs import hookimpl


@hookimpl
def paged_platforms() -> list[type]:
    from paged_rocm.platform import RocmPlatform

    return [RocmPlatform]
