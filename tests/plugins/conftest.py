"""Fixtures for the platform-plugin tests: the in-tree plugins importable and registered,
and one Triton-interpreter run that checks the GPU plugins' Triton backends on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
for _plugin in ("rocm", "xpu"):  # when the plugins are not installed, test them from the tree
    if find_spec(f"paged_{_plugin}") is None:
        sys.path.insert(0, str(ROOT / "plugins" / _plugin))

TRITON_BACKENDS = (
    "paged_rocm.attention:RocmTritonAttentionBackend",
    "paged_xpu.triton_attention:XpuTritonAttentionBackend",
)


@pytest.fixture
def registered(monkeypatch):
    """Make sure a plugin's hooks are registered (as its entry point would), and that no
    PAGED_PLATFORM / PAGED_PLUGINS from the environment interferes."""
    from paged.plugins import get_plugin_manager

    monkeypatch.delenv("PAGED_PLATFORM", raising=False)
    pm, added = get_plugin_manager(), []

    def register(module) -> None:
        if not pm.is_registered(module):
            pm.register(module)
            added.append(module)

    yield register
    for module in added:
        pm.unregister(module)


@pytest.fixture(scope="session")
def interpreted_report() -> dict:
    """attn_reference.py under TRITON_INTERPRET=1 in a subprocess: probing imports no vendor
    module, and the Triton backends of rocm and xpu match the cpu backend."""
    if find_spec("triton") is None:
        pytest.skip("triton is not installed")
    paths = [str(ROOT / "plugins" / p) for p in ("rocm", "xpu")]
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")])
    r = subprocess.run(
        [sys.executable, str(HERE / "attn_reference.py"), *TRITON_BACKENDS],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])
