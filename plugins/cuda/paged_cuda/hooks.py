"""Entry point of the CUDA plugin (group ``paged``): nothing heavy at import."""

from __future__ import annotations

from paged.hookspecs import hookimpl


@hookimpl
def paged_platforms() -> list[type]:
    from paged_cuda.platform import CudaPlatform

    return [CudaPlatform]
