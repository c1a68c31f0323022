"""Entry point of the XPU plugin (group ``paged``): imports neither IPEX nor a device."""

from __future__ import annotations

from paged.hookspecs import hookimpl


@hookimpl
def paged_platforms() -> list[type]:
    from paged_xpu.platform import XpuPlatform

    return [XpuPlatform]
