"""Entry point of the CPU plugin (group ``paged``)."""

from __future__ import annotations

from paged.hookspecs import hookimpl


@hookimpl
def paged_platforms() -> list[type]:
    from paged_cpu.platform import CpuPlatform

    return [CpuPlatform]
