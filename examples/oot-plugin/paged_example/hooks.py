"""The module named by the entry point: hook implementations only, nothing heavy at import."""

from __future__ import annotations

from paged.hookspecs import hookimpl


@hookimpl
def paged_platforms() -> list[type]:
    from paged_example.platform import ExamplePlatform  # imported when paged asks, not before

    return [ExamplePlatform]
