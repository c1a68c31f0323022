"""Shared by the benchmarks: a vLLM-style result table, ``--save-json``, and their flag checks."""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time


def print_metrics(
    title: str,
    m: dict,
    rows: list[tuple[str, str]],
    sections: list[tuple[str, str]] = (),
    quantiles: tuple[str, ...] = ("mean", "median", "p90", "p99"),
) -> None:
    """Rows of (label, key); each section (title, name) prints m['<q>_<name>_ms']."""
    print(f"{' ' + title + ' ':=^60}")
    for label, key in rows:
        v = m[key]
        print(
            f"{label + ':':<44}{v:>16.2f}" if isinstance(v, float) else f"{label + ':':<44}{v:>16}"
        )
    for head, name in sections:
        print(f"{' ' + head + ' ':-^60}")
        for q in quantiles:
            key = f"{q}_{name}_ms"
            if key in m:
                label = f"{q.capitalize() if q[0] != 'p' else q.upper()} {name.upper()} (ms):"
                print(f"{label:<44}{m[key]:>16.2f}")
    print("=" * 60)


def _plain(v):
    """JSON-safe: infinities as strings, unknown objects as their repr."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v if isinstance(v, str | int | float | bool | None | list | dict) else repr(v)


def stats(name: str, seconds: list[float]) -> dict[str, float]:
    """mean/median/std/p50/p90/p99 of a list of seconds, as '<q>_<name>_ms' keys."""
    import numpy as np

    v = np.asarray(seconds or [0.0]) * 1000
    return {
        f"mean_{name}_ms": float(v.mean()),
        f"median_{name}_ms": float(np.median(v)),
        f"std_{name}_ms": float(v.std()),
        **{f"p{q}_{name}_ms": float(np.percentile(v, q)) for q in (50, 90, 99)},
    }


def save_json(path: str, args: argparse.Namespace, metrics: dict) -> None:
    """All figures, plus the command line and arguments that produced them."""
    plain = {k: _plain(v) for k, v in vars(args).items() if not callable(v) and k[0] != "_"}
    record = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": shlex.join(["paged", *getattr(args, "_argv", sys.argv[1:])]),
        "args": plain,
        **metrics,
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2)
    print(f"saved {path}", file=sys.stderr)


def flag_error(
    args: argparse.Namespace, least: dict[str, float], above: dict[str, float] | None = None
) -> str:
    """The first flag below its `least` value or not above its `above` bound, as a message
    naming it ('' when all are fine); a flag unset (None) or absent is skipped, nan refused."""
    for name, bound in least.items():
        v = getattr(args, name, None)
        if v is not None and not v >= bound:
            return f"--{name.replace('_', '-')} must be at least {bound}, not {v}"
    for name, bound in (above or {}).items():
        v = getattr(args, name, None)
        if v is not None and not v > bound:
            return f"--{name.replace('_', '-')} must be more than {bound}, not {v}"
    return ""


def save_json_error(path: str | None) -> str:
    """Why --save-json could not be written, found before the benchmark runs ('' if it can)."""
    if not path:
        return ""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return f"--save-json: {path} is a directory"
    if not os.path.isdir(folder):
        return f"--save-json: no directory {folder}"
    if not os.access(folder, os.W_OK) or os.path.exists(path) and not os.access(path, os.W_OK):
        return f"--save-json: cannot write {path}"
    return ""
