"""``paged platforms``: every platform found, available or why not, and the one chosen."""

from __future__ import annotations

import argparse
import json
import os


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "platforms",
        help="list platform plugins: available or why not, and which one would be chosen",
    )
    p.add_argument("--platform", default=None, help="the one to force (also PAGED_PLATFORM)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def chosen_platform(rows: list, forced: str | None) -> tuple[str | None, str]:
    """(name chosen or None, why): the forced one when it is usable, else the best one."""
    from paged.plugins import PLATFORM_ENV

    source = "--platform" if forced else PLATFORM_ENV
    forced = forced or os.environ.get(PLATFORM_ENV) or None
    if forced:
        row = next((r for r in rows if r.name == forced), None)
        if row is None:
            return None, f"{source} forces {forced!r}, but no platform has that name"
        if not row.available:
            return None, f"{source} forces {forced!r}, but it is not available: {row.reason}"
        return forced, f"forced by {source}"
    best = next((r for r in rows if r.available), None)
    if best is None:
        return None, "no platform is available (pip install paged[cpu] for the CPU fallback)"
    return best.name, "highest priority among the available"


def run(args: argparse.Namespace) -> int:
    from paged.plugins import probe_platforms

    rows = probe_platforms()
    name, why = chosen_platform(rows, args.platform)
    if args.json:
        table = [
            {
                "name": r.name,
                "priority": r.priority,
                "available": r.available,
                "reason": r.reason or None,
                "module": r.cls.__module__ if r.cls is not None else None,
                "distribution": r.dist or None,
            }
            for r in rows
        ]
        print(json.dumps({"platforms": table, "selected": name, "why": why}, indent=2))
        return 0 if name else 1
    if not rows:
        print("no platform plugins installed: pip install paged[cpu] (or [cuda], [rocm], ...)")
        return 1
    width = max(8, *(len(r.name) for r in rows))
    print(f"  {'PLATFORM':<{width}}  PRIORITY  STATUS")
    for r in rows:
        mark = "*" if r.name == name else " "
        status = "available" if r.available else f"unavailable: {r.reason}"
        print(f"{mark} {r.name:<{width}}  {r.priority:>8}  {status}")
    print(f"\nselected: {name} ({why})" if name else f"\nselected: none ({why})")
    return 0 if name else 1
