"""The CPU plugin's C++ kernels (csrc/: paged decode attention, GGUF block linears, fused
elementwise ops).

Built once, ahead of serving: ``python -m paged_cpu.native`` (``make install`` runs it). The
build is cached under ``$PAGED_CACHE_DIR/cpu-kernels/`` (default ``~/.cache/paged``) by a key
of the sources, the torch and Python versions, the compiler flags and this CPU, so that
checkouts and virtual environments on one host share what is the same and never overwrite
each other. Each build runs in its own directory under an OS file lock (released if the build
dies), then the module is moved into place atomically: an interrupted build leaves nothing
another process waits on.

An engine only loads a finished build (`kernels()`); it never compiles. Without one (no build
yet, no compiler, or switched off: ``--no-cpu-native``, ``LLM(cpu_native=False)``, fallback
``PAGED_CPU_NATIVE=0``), `kernels()` is None and the backend uses torch ops instead.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

log = logging.getLogger("paged")
CSRC = Path(__file__).parent / "csrc"
SOURCES = [
    CSRC / name
    for name in ("bindings.cpp", "elementwise.cpp", "paged_attention.cpp", "quant_linear.cpp")
]
CFLAGS = ["-O3", "-march=native", "-fopenmp"]
BUILD_COMMAND = "python -m paged_cpu.native"


def _cpu_id() -> str:
    """What -march=native compiles for: the CPU's model and feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    keep = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


def build_key() -> str:
    import torch

    h = hashlib.sha256()
    for path in sorted(CSRC.iterdir()):
        if path.suffix in (".cpp", ".h"):
            h.update(path.name.encode() + b"\0" + path.read_bytes())
    for part in (torch.__version__, sys.version, " ".join(CFLAGS), platform.machine(), _cpu_id()):
        h.update(b"\0" + part.encode())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    root = os.environ.get("PAGED_CACHE_DIR") or Path.home() / ".cache" / "paged"
    return Path(root) / "cpu-kernels"


def module_path(key: str | None = None) -> Path:
    key = key or build_key()
    return cache_dir() / key / f"paged_cpu_kernels_{key}.so"


def _import(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def kernels(enabled: bool = True) -> Any | None:
    """The built kernels module, or None (torch ops instead): always None when not `enabled`
    (the platform's cpu_native option). Never compiles."""
    return _load() if enabled else None


@cache
def _load() -> Any | None:
    import torch  # noqa: F401  (the module links against torch's libraries)

    path = module_path()
    if path.stem in sys.modules:  # built by this process
        return sys.modules[path.stem]
    if not path.exists():
        log.warning(
            "paged-cpu C++ kernels are not built for these sources, this torch and this CPU "
            "(%s): using torch ops (slower). Build them once with `%s`.",
            path.parent.name,
            BUILD_COMMAND,
        )
        return None
    try:
        return _import(path)
    except Exception as e:  # a broken file: torch ops, and say how to rebuild
        log.warning("cannot load %s (%s): using torch ops; rebuild with `%s`", path, e,
                    BUILD_COMMAND)  # fmt: skip
        return None


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive OS lock on `path`: released by the kernel if this process dies."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build(verbose: bool = False) -> Path:
    """Compile the kernels for this key unless already built; returns the module's path."""
    key = build_key()
    final = module_path(key)
    if final.exists():
        return final
    with _locked(cache_dir() / f"{key}.lock"):
        if final.exists():  # another process built it while we waited
            return final
        _remove_stale_builds()
        if shutil.which("ninja") is None:  # pip's ninja, when its venv's bin/ is not on PATH
            with contextlib.suppress(ImportError):
                import ninja

                os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        from torch.utils.cpp_extension import load

        work = Path(tempfile.mkdtemp(prefix="build-", dir=cache_dir()))
        try:
            name = final.stem
            load(
                name=name,
                sources=[str(s) for s in SOURCES],
                extra_cflags=CFLAGS,
                build_directory=str(work),
                verbose=verbose,
            )
            built = work / f"{name}.so"
            final.parent.mkdir(parents=True, exist_ok=True)
            tmp = final.with_suffix(".so.tmp")
            shutil.copyfile(built, tmp)
            os.replace(tmp, final)  # atomic: a reader sees no file or a whole one
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return final


def _remove_stale_builds(age_s: float = 3600) -> None:
    """Build directories of processes killed mid-build (we hold the lock: none is running
    for this key; others' are younger than an hour)."""
    now = time.time()
    for d in cache_dir().glob("build-*"):
        with contextlib.suppress(OSError):
            if now - d.stat().st_mtime > age_s:
                shutil.rmtree(d, ignore_errors=True)


def main() -> int:
    t0 = time.perf_counter()
    try:
        path = build(verbose="-v" in sys.argv)
    except Exception as e:  # no compiler, no ninja, a build error
        print(f"paged-cpu: cannot build the C++ kernels ({e}); torch ops will be used")
        return 1
    print(f"paged-cpu: C++ kernels ready in {time.perf_counter() - t0:.1f} s: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
