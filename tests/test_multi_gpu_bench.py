"""bench/multi_gpu.py (issue 17's multi-GPU runbook): its CPU smoke mode end to end (tiny
models, TP=2 against TP=1 over gloo), and how it judges a divergence (near-tie or not)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from bench_scripts import BENCH, load_bench


def _module():
    """bench/multi_gpu.py (it imports h200 and common)."""
    return load_bench("multi_gpu")


def test_compare_reports_the_first_divergence_and_its_gap():
    mg = _module()
    ref = {"tokens": [[1, 2, 3], [4, 5, 6]], "top2": [[[-0.1, -2.0]] * 3, [[-1.0, -1.0005]] * 3]}
    same = mg.compare(ref, {"tokens": [[1, 2, 3], [4, 5, 6]]}, 1e-3)
    assert same["identical"] == "2/2" and same["passed"]
    tie = mg.compare(ref, {"tokens": [[1, 2, 3], [4, 7, 6]]}, 1e-3)  # parts at a near-tie
    assert tie["identical"] == "1/2" and tie["passed"]
    assert tie["prompts"][1] == pytest.approx(
        {"prompt": 1, "identical": False, "first_diff": 1, "tp1_top2_gap": 5e-4, "near_tie": True}
    )
    real = mg.compare(ref, {"tokens": [[1, 9, 3], [4, 5, 6]]}, 1e-3)  # a gap of 1.9: a bug
    assert not real["passed"] and real["prompts"][0]["first_diff"] == 1
    assert not mg.compare(ref, {}, 1e-3)["passed"]  # an engine that failed


@pytest.mark.slow  # about a minute on two cores: four engines, two of them with a worker
def test_cpu_smoke_tensor_parallel_matches_one_rank(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(BENCH / "multi_gpu.py"), "--cpu-smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "multi_gpu.json").read_text())["results"]["correctness"]
    runs = {(m, v): r for m, variants in res["models"].items() for v, r in variants.items()}
    assert set(runs) == {("llama", "eager"), ("qwen3_moe", "eager")}
    for key, r in runs.items():
        assert r["identical"] == f"{len(r['prompts'])}/{len(r['prompts'])}", (key, r)
    assert res["passed"]
    assert "| **pass** |" in (tmp_path / "multi_gpu.md").read_text()
