"""The plugin contract: entry-point discovery, forcing, refusal messages; core purity."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PLUGIN = """
import torch
from paged.hookspecs import hookimpl
from paged.platform import Platform
from paged_cpu.platform import CpuPlatform

class ToyPlatform(CpuPlatform):
    name = "toy"
    priority = 1

class BrokenPlatform(Platform):
    name = "broken"
    priority = 500
    @classmethod
    def probe(cls):
        return "no broken device here"

@hookimpl
def paged_platforms():
    return [ToyPlatform, BrokenPlatform]
"""


def make_plugin(tmp: Path) -> dict[str, str]:
    (tmp / "toy_plugin.py").write_text(PLUGIN)
    dist = tmp / "toy_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[paged]\ntoy = toy_plugin\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = str(tmp) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("PAGED_PLATFORM", None)
    return env


def run_py(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_plugin_is_discovered_and_can_be_forced(tmp_path):
    env = make_plugin(tmp_path)
    code = """
    from paged.plugins import probe_platforms, select_platform
    rows = {r.name: r for r in probe_platforms()}
    print(sorted(rows), rows["broken"].reason)
    print("has", {"broken", "cpu", "toy"} <= set(rows))
    print("chosen", select_platform().name)
    """
    r = run_py(code, env)
    assert r.returncode == 0, r.stderr
    assert "has True" in r.stdout and "no broken device here" in r.stdout
    assert "chosen cpu" in r.stdout  # highest-priority available
    r = run_py(code, {**env, "PAGED_PLATFORM": "toy"})
    assert "chosen toy" in r.stdout, r.stderr


def test_forcing_unavailable_platform_lists_reasons(tmp_path):
    env = make_plugin(tmp_path)
    r = run_py(
        "from paged.plugins import select_platform; select_platform()",
        {**env, "PAGED_PLATFORM": "broken"},
    )
    assert r.returncode != 0
    assert "not available: no broken device here" in r.stderr
    assert "toy" in r.stderr and "cpu" in r.stderr


def test_forced_plugin_serves_generation(tmp_path, tiny_models):
    env = make_plugin(tmp_path)
    code = f"""
    from paged import LLM, SamplingParams
    llm = LLM({tiny_models["llama"]!r}, dtype="float32", num_kv_blocks=64)
    out = llm.generate([[3, 4, 5]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    print(llm.engine.platform.name, len(out[0].outputs[0].token_ids))
    """
    r = run_py(code, {**env, "PAGED_PLATFORM": "toy"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[-2:] == ["toy", "4"]


def test_core_has_no_device_specific_imports():
    pattern = re.compile(r"torch\.(cuda|xpu|mps)\b|import torch_xla|intel_extension_for_pytorch")
    offenders = []
    for path in (ROOT / "core" / "paged").rglob("*.py"):
        if "kernels" in path.relative_to(ROOT / "core" / "paged").parts:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not offenders, "device-specific code in core/:\n" + "\n".join(offenders)
