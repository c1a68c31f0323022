"""Plugin manager: loads the ``paged`` entry-point group and selects a platform."""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

import pluggy

from paged import hookspecs

if TYPE_CHECKING:
    from paged.platform import Platform

# Comma-separated allow-list of plugin names to load (unset: load all).
PLUGINS_ENV = "PAGED_PLUGINS"
PLATFORM_ENV = "PAGED_PLATFORM"


@cache
def get_plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager("paged")
    pm.add_hookspecs(hookspecs)
    allow = os.environ.get(PLUGINS_ENV)
    if allow is None:
        pm.load_setuptools_entrypoints("paged")
    else:
        names = {n.strip() for n in allow.split(",") if n.strip()}
        for name in names:
            pm.load_setuptools_entrypoints("paged", name=name)
    from paged import builtin_hooks

    pm.register(builtin_hooks, name="paged.builtin")
    return pm


def all_platforms() -> list[type[Platform]]:
    seen: dict[str, type[Platform]] = {}
    for group in get_plugin_manager().hook.paged_platforms():
        for cls in group or []:
            seen.setdefault(cls.name, cls)
    return list(seen.values())


def extra_models() -> dict[str, type]:
    models: dict[str, type] = {}
    for group in get_plugin_manager().hook.paged_models():
        models.update(group or {})
    return models


@dataclass
class PlatformStatus:
    name: str
    priority: int
    available: bool
    reason: str  # why it was refused, "" when available
    cls: type[Platform]


def probe_platforms() -> list[PlatformStatus]:
    """Every platform found, available or not and why, highest priority first."""
    rows = []
    for cls in all_platforms():
        try:
            reason = cls.probe()
        except Exception as e:  # a broken plugin must not break selection
            reason = f"probe failed: {type(e).__name__}: {e}"
        rows.append(PlatformStatus(cls.name, cls.priority, reason is None, reason or "", cls))
    rows.sort(key=lambda r: (-r.priority, r.name))
    return rows


class NoPlatformError(RuntimeError):
    pass


def select_platform(name: str | None = None) -> Platform:
    """The forced platform (argument or PAGED_PLATFORM), else the best available one."""
    name = name or os.environ.get(PLATFORM_ENV) or None
    rows = probe_platforms()
    table = (
        "\n".join(
            f"  {r.name:<8} priority={r.priority:<4} "
            + ("available" if r.available else f"refused: {r.reason}")
            for r in rows
        )
        or "  (no platform plugins installed: pip install paged[cpu])"
    )
    if name:
        for r in rows:
            if r.name == name:
                if not r.available:
                    raise NoPlatformError(
                        f"platform {name!r} is not available: {r.reason}\n{table}"
                    )
                return r.cls()
        raise NoPlatformError(f"no platform named {name!r}; found:\n{table}")
    for r in rows:
        if r.available:
            return r.cls()
    raise NoPlatformError(f"no usable platform; found:\n{table}")
