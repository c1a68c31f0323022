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


def _add_dist(tmp: Path, module: str, source: str, dist: str) -> None:
    (tmp / f"{module}.py").write_text(source)
    info = tmp / f"{module}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[paged]\n{module} = {module}\n")


SHADOW = """
from paged.hookspecs import hookimpl
from paged_cpu.platform import CpuPlatform

class Shadow(CpuPlatform):
    name = "cpu"
    priority = 1000

@hookimpl
def paged_platforms():
    return [Shadow]
"""


def test_broken_and_clashing_plugins_are_listed_not_fatal(tmp_path):
    env = make_plugin(tmp_path)
    _add_dist(tmp_path, "bad_import", "import no_such_module_xyz\n", "bad-import-plugin")
    _add_dist(tmp_path, "zz_shadow", SHADOW, "shadow-plugin")
    r = subprocess.run(
        [sys.executable, "-m", "paged.cli.main", "platforms"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    out = r.stdout
    assert "bad_import" in out and "no_such_module_xyz" in out, out
    assert "toy" in out  # the good plugin still loads
    clash = next(ln for ln in out.splitlines() if "already taken" in ln)
    assert "paged-cpu" in clash and "shadow-plugin" in clash, clash
    assert "selected: cpu" in out
    r = run_py("from paged.plugins import select_platform; print(type(select_platform()))", env)
    assert "CpuPlatform" in r.stdout, r.stdout + r.stderr  # not the shadowing class


def test_declared_markers_are_used():
    import tomllib

    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    names = [m.split(":")[0] for m in cfg["tool"]["pytest"]["ini_options"]["markers"]]
    text = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("*.py"))
    unused = [n for n in names if f"pytest.mark.{n}" not in text]
    assert not unused, f"markers declared in pyproject.toml but never used: {unused}"
