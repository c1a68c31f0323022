"""The CPU plugin's C++ kernel cache: keyed by what the build depends on, loaded (never built)
by engines, and safe against builds killed half-way."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from paged_cpu import native


def _run(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def test_key_follows_sources_and_torch(tmp_path, monkeypatch):
    base = native.build_key()
    copy = tmp_path / "csrc"
    shutil.copytree(native.CSRC, copy)
    monkeypatch.setattr(native, "CSRC", copy)
    assert native.build_key() == base  # same sources, another checkout: the same build
    with open(copy / "ops.h", "a") as f:
        f.write("\n// changed\n")
    changed = native.build_key()
    assert changed != base
    import torch

    monkeypatch.setattr(torch, "__version__", "0.0.1-other")
    assert native.build_key() not in (base, changed)


def test_engines_never_compile(tmp_path):
    """No build for this key: torch ops and a hint, at once, even with a stale torch lock in
    the old shared location that used to make every start wait forever."""
    stale = tmp_path / "torch_extensions" / "paged_cpu_kernels"
    stale.mkdir(parents=True)
    (stale / "lock").write_text("")
    env = dict(os.environ, PAGED_CACHE_DIR=str(tmp_path / "cache"),
               TORCH_EXTENSIONS_DIR=str(tmp_path / "torch_extensions"))  # fmt: skip
    code = """
    import logging, time
    logging.basicConfig(level="WARNING")
    import torch.utils.cpp_extension as ext
    def refuse(*a, **k):
        raise AssertionError("an engine compiled the kernels")
    ext.load = refuse
    from paged_cpu.native import kernels
    t = time.perf_counter()
    print("result", kernels(), round(time.perf_counter() - t, 2))
    """
    r = _run(code, env)
    assert r.returncode == 0, r.stderr
    assert "result None" in r.stdout
    assert float(r.stdout.split()[-1]) < 5
    assert "python -m paged_cpu.native" in r.stderr


def test_a_finished_build_is_loaded_without_compiling(tmp_path):
    built = native.module_path()
    if not built.exists():
        assert not os.environ.get("CI"), "make install builds the kernels in CI"
        pytest.skip("no C++ kernels built here")
    cache = tmp_path / "cache"
    target = cache / "cpu-kernels" / built.parent.name / built.name
    target.parent.mkdir(parents=True)
    shutil.copyfile(built, target)
    env = dict(os.environ, PAGED_CACHE_DIR=str(cache))
    code = """
    import torch.utils.cpp_extension as ext
    def refuse(*a, **k):
        raise AssertionError("compiled")
    ext.load = refuse
    from paged_cpu.native import kernels
    print("module", kernels().__file__)
    """
    r = _run(code, env)
    assert r.returncode == 0, r.stderr
    assert str(target) in r.stdout


def test_the_build_lock_dies_with_its_holder(tmp_path):
    lock = tmp_path / "k.lock"
    code = f"""
    import time
    from pathlib import Path
    from paged_cpu.native import _locked
    with _locked(Path({str(lock)!r})):
        print("held", flush=True)
        time.sleep(600)
    """
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert holder.stdout.readline().strip() == "held"
    holder.send_signal(signal.SIGKILL)  # a build killed half-way
    holder.wait(10)
    t = time.perf_counter()
    with native._locked(lock):
        pass
    assert time.perf_counter() - t < 5
