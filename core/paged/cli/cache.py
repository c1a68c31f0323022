"""``paged cache``: what paged keeps under $PAGED_CACHE_DIR (default ~/.cache/paged), and
removing it. GGUF conversions (a file's tokenizer, config, weights and blocks: loader.py) take
0.7 GB for the default model and gigabytes for an 8B file; the cpu plugin's kernel builds live
beside them (`cpu-kernels`). Everything there is rebuilt on demand, so removing is safe."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

# what the loader writes (loader.py), with the kinds of earlier cache versions
CONVERSIONS = ("tokenizers", "configs", "weights", "blocks", "blocks2", "blocks3")
KERNELS = "cpu-kernels"


@dataclass
class Entry:
    kind: str  # tokenizers, configs, weights, weights-less-<skip set>, blocks3, cpu-kernels
    name: str  # the entry's directory: <source file>-<hash of its content and converter>
    bytes: int
    written: str  # ISO date of the entry's last change

    def source(self) -> str:
        return self.name.rpartition("-")[0] or self.name


def _kinds(root: Path, kernels: bool) -> list[Path]:
    if not root.is_dir():
        return []
    names = set(CONVERSIONS) | ({KERNELS} if kernels else set())
    return sorted(d for d in root.iterdir() if d.is_dir() and (
        d.name in names or d.name.startswith("weights-less-")))  # fmt: skip


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def entries(root: Path, kernels: bool = True) -> list[Entry]:
    """Every cache entry under root (half-written ones, named with a leading dot, and the
    kernel builds' lock files left out)."""
    out = []
    for kind in _kinds(root, kernels):
        for d in sorted(kind.iterdir()):
            if d.name.startswith(".") or not d.is_dir():  # half-written, or a build's lock
                continue
            when = dt.datetime.fromtimestamp(d.stat().st_mtime, dt.UTC).date().isoformat()
            out.append(Entry(kind.name, d.name, _size(d), when))
    return out


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cache", help="list or remove what paged caches (GGUF conversions, "
                       "kernel builds)", description="What paged keeps under $PAGED_CACHE_DIR "
                       "(default ~/.cache/paged): GGUF conversions and the cpu kernels' builds, "
                       "all rebuilt when next needed. With no action: list.")  # fmt: skip
    p.set_defaults(func=list_entries)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    cmds = p.add_subparsers(dest="cache_command", metavar="ACTION")
    ls = cmds.add_parser("list", help="the cache's entries, their sizes and sources")
    ls.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ls.set_defaults(func=list_entries)
    rm = cmds.add_parser("clear", help="remove cache entries (rebuilt when next needed)")
    rm.add_argument("sources", nargs="*", metavar="FILE",
                    help="the GGUF files (by name, e.g. SmolLM2-135M-Instruct.Q4_1.gguf) whose "
                    "conversions to remove")  # fmt: skip
    rm.add_argument("--all", action="store_true", help="every conversion, and the digests")
    rm.add_argument("--kernels", action="store_true", help="also the cpu plugin's kernel builds")
    rm.add_argument("--dry-run", action="store_true", help="say what would go, remove nothing")
    rm.set_defaults(func=clear)


def _root() -> Path:
    from paged.model.loader import cache_root

    return cache_root()


def list_entries(args: argparse.Namespace) -> int:
    root = _root()
    found = entries(root)
    total = sum(e.bytes for e in found)
    if args.json:
        print(json.dumps({"root": str(root), "bytes": total, "entries": [asdict(e) for e in found]},
                         indent=2))  # fmt: skip
        return 0
    if not found:
        print(f"{root}: empty")
        return 0
    header = ("KIND", "SOURCE", "SIZE", "WRITTEN")
    table = [(e.kind, e.source(), _human(e.bytes), e.written) for e in found]
    widths = [max(len(h), *(len(t[i]) for t in table)) for i, h in enumerate(header)]
    for line in (header, *table):
        print("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip())
    print(f"\n{len(found)} entries, {_human(total)} in {root}; `paged cache clear FILE` or "
          "`--all` removes them (rebuilt when next needed)")  # fmt: skip
    return 0


def clear(args: argparse.Namespace) -> int:
    if not args.sources and not args.all and not args.kernels:
        raise ValueError("paged cache clear: name the files whose conversions to remove, or "
                         "--all (every conversion), or --kernels")  # fmt: skip
    root = _root()
    names = set(args.sources)
    gone = [e for e in entries(root, kernels=args.kernels)
            if (e.kind == KERNELS and args.kernels)
            or (e.kind != KERNELS and (args.all or e.source() in names))]  # fmt: skip
    unknown = names - {e.source() for e in gone}
    for e in gone:
        print(f"{'would remove' if args.dry_run else 'removing'} {e.kind}/{e.name} "
              f"({_human(e.bytes)})")  # fmt: skip
        if not args.dry_run:
            shutil.rmtree(root / e.kind / e.name, ignore_errors=True)
    if args.all and not args.dry_run:
        shutil.rmtree(root / "digests", ignore_errors=True)
    freed = sum(e.bytes for e in gone)
    print(f"{'would free' if args.dry_run else 'freed'} {_human(freed)}")
    if unknown:
        print(f"no entries for: {', '.join(sorted(unknown))}")
    return 0


def _human(n: float) -> str:
    if n < 1000:
        return f"{n:.0f} B"
    for unit in ("KB", "MB", "GB"):
        n /= 1000
        if n < 1000 or unit == "GB":
            break
    return f"{n:.1f} {unit}"
