"""Plugin manager: loads the ``paged`` entry-point group and selects a platform.

A plugin that fails to import, or whose hook raises, is logged and skipped (and listed by
``paged platforms`` with the reason); it never stops the others. A platform whose name an
earlier plugin already took is refused, naming both distributions.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from functools import cache
from importlib.metadata import entry_points
from typing import TYPE_CHECKING

import pluggy

from paged import hookspecs

if TYPE_CHECKING:
    from paged.platform import Platform

log = logging.getLogger("paged")

# Comma-separated allow-list of plugin names to load (unset: load all).
PLUGINS_ENV = "PAGED_PLUGINS"
PLATFORM_ENV = "PAGED_PLATFORM"
BUILTIN = "paged.builtin"


@dataclass
class BrokenPlugin:
    name: str  # the entry point's name
    dist: str  # the distribution that declares it
    reason: str


@dataclass
class Plugins:
    manager: pluggy.PluginManager
    dists: dict[str, str]  # plugin name -> distribution name
    broken: list[BrokenPlugin]


@cache
def plugins() -> Plugins:
    pm = pluggy.PluginManager("paged")
    pm.add_hookspecs(hookspecs)
    allow = os.environ.get(PLUGINS_ENV)
    names = None if allow is None else {n.strip() for n in allow.split(",") if n.strip()}
    dists: dict[str, str] = {BUILTIN: "paged"}
    broken: list[BrokenPlugin] = []
    for ep in sorted(entry_points(group="paged"), key=lambda e: e.name):
        if (names is not None and ep.name not in names) or pm.has_plugin(ep.name):
            continue
        dist = ep.dist.name if ep.dist is not None else "?"
        try:
            pm.register(ep.load(), name=ep.name)
        except Exception as e:  # an import error, a bad hook: skip this plugin only
            reason = f"cannot load {ep.value}: {type(e).__name__}: {e}"
            log.warning("plugin %r (%s) skipped: %s", ep.name, dist, reason)
            broken.append(BrokenPlugin(ep.name, dist, reason))
            continue
        dists[ep.name] = dist
    from paged import builtin_hooks

    pm.register(builtin_hooks, name=BUILTIN)
    return Plugins(pm, dists, broken)


def get_plugin_manager() -> pluggy.PluginManager:
    return plugins().manager


@dataclass
class PlatformStatus:
    name: str
    priority: int
    available: bool
    reason: str  # why it was refused, "" when available
    cls: type[Platform] | None  # None: refused before probing (a clash, a broken plugin)
    dist: str = ""  # the distribution that provides it


def _hook_results(hook_name: str) -> list[tuple[str, object]]:
    """(distribution, result) of every plugin's implementation of a hook; a hook that raises
    is logged and recorded as a broken plugin."""
    p = plugins()
    out = []
    for impl in getattr(p.manager.hook, hook_name).get_hookimpls():
        dist = p.dists.get(impl.plugin_name, impl.plugin_name)
        try:
            out.append((dist, impl.function()))
        except Exception as e:
            reason = f"{hook_name}() raised {type(e).__name__}: {e}"
            _report(f"plugin {impl.plugin_name!r} ({dist}) skipped: {reason}")
            if not any(b.name == impl.plugin_name for b in p.broken):
                p.broken.append(BrokenPlugin(impl.plugin_name, dist, reason))
    return out


_reported: set[str] = set()  # problems already logged (the table is rebuilt on each call)


def _report(message: str) -> None:
    if message not in _reported:
        _reported.add(message)
        log.warning("%s", message)


def _platform_table() -> tuple[dict[str, tuple[type[Platform], str]], list[PlatformStatus]]:
    """({name: (class, distribution)}, rows refused for a name clash)."""
    seen: dict[str, tuple[type[Platform], str]] = {}
    clashes: list[PlatformStatus] = []
    for dist, group in _hook_results("paged_platforms"):  # in registration order
        for cls in group or []:
            if cls.name not in seen:
                seen[cls.name] = (cls, dist)
            elif seen[cls.name][0] is not cls:
                first = seen[cls.name][1]
                reason = (
                    f"refused: the platform name {cls.name!r} is already taken by {first}; "
                    f"{dist} must use another name"
                )
                _report(f"platform {cls.name!r} of {dist} {reason}")
                clashes.append(PlatformStatus(cls.name, cls.priority, False, reason, None, dist))
    return seen, clashes


def all_platforms() -> list[type[Platform]]:
    return [cls for cls, _ in _platform_table()[0].values()]


def extra_models() -> dict[str, type]:
    models: dict[str, type] = {}
    for _, group in _hook_results("paged_models"):
        models.update(group or {})
    return models


def probe_platforms() -> list[PlatformStatus]:
    """Every platform found, available or not and why, highest priority first; then the
    refused ones (name clashes) and plugins that could not load."""
    seen, clashes = _platform_table()
    rows = []
    for cls, dist in seen.values():
        try:
            reason = cls.probe()
        except Exception as e:  # a broken plugin must not break selection
            reason = f"probe failed: {type(e).__name__}: {e}"
        rows.append(PlatformStatus(cls.name, cls.priority, reason is None, reason or "", cls, dist))
    rows.sort(key=lambda r: (-r.priority, r.name))
    broken = [
        PlatformStatus(f"({b.name})", 0, False, f"plugin not loaded: {b.reason}", None, b.dist)
        for b in plugins().broken
    ]
    return rows + clashes + broken


class NoPlatformError(RuntimeError):
    pass


def platform_class(name: str | None = None) -> type[Platform] | None:
    """The class select_platform would use, without creating it: the forced platform's
    (argument or PAGED_PLATFORM; None when no plugin has that name), else the best available
    one (None when none is)."""
    name = name or os.environ.get(PLATFORM_ENV) or None
    if name:
        found = _platform_table()[0].get(name)
        return found[0] if found else None
    return next((r.cls for r in probe_platforms() if r.available and r.cls), None)


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
    usable = [r for r in rows if r.cls is not None]
    if name:
        for r in usable:
            if r.name == name:
                if not r.available:
                    raise NoPlatformError(
                        f"platform {name!r} is not available: {r.reason}\n{table}"
                    )
                return r.cls()
        raise NoPlatformError(f"no platform named {name!r}; found:\n{table}")
    for r in usable:
        if r.available:
            return r.cls()
    raise NoPlatformError(f"no usable platform; found:\n{table}")
