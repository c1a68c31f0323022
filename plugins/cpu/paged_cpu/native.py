"""The CPU plugin's C++ kernels (csrc/: paged decode attention, GGUF block linears, fused
elementwise ops), compiled on first use with torch's extension builder
and cached (TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions). Without a compiler, or
with PAGED_CPU_NATIVE=0, `kernels()` is None and the backend uses torch ops instead."""

from __future__ import annotations

import logging
import os
import shutil
from functools import cache
from pathlib import Path
from typing import Any

log = logging.getLogger("paged")
CSRC = Path(__file__).parent / "csrc"
SOURCES = [
    CSRC / name
    for name in ("bindings.cpp", "elementwise.cpp", "paged_attention.cpp", "quant_linear.cpp")
]


@cache
def kernels() -> Any | None:
    if os.environ.get("PAGED_CPU_NATIVE", "1") == "0":
        return None
    if shutil.which("ninja") is None:  # pip's ninja, when its venv's bin/ is not on PATH
        try:
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass
    try:
        from torch.utils.cpp_extension import load

        return load(
            name="paged_cpu_kernels",
            sources=[str(s) for s in SOURCES],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # no compiler, no ninja, a build error: torch ops instead
        log.warning("paged-cpu C++ kernels unavailable (%s); using torch ops", e)
        return None
