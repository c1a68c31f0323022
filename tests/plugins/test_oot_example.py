"""examples/oot-plugin, installed as a vendor would ship it: it is listed by `paged platforms`
and, forced with PAGED_PLATFORM, generates the same greedy tokens as the cpu platform."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def example_env(oot_plugin_site) -> dict[str, str]:
    site = Path(oot_plugin_site)
    assert (site / "paged_example_plugin-0.1.0.dist-info" / "entry_points.txt").exists()
    env = dict(os.environ, PYTHONPATH=str(site) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("PAGED_PLUGINS", None)
    env["PAGED_PLATFORM"] = "example"
    return env


SCRIPT = """
import contextlib, io, json, sys
from paged import LLM, SamplingParams
from paged.cli.main import main

buf = io.StringIO()
with contextlib.redirect_stdout(buf):
    main(["platforms", "--json"])
result = {"platforms": json.loads(buf.getvalue())}
prompts = [[3, 4, 5, 6, 7], list(range(10, 60)), [9] * 23]
params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
for platform in (None, "cpu"):  # None: whatever PAGED_PLATFORM says
    llm = LLM(sys.argv[1], dtype="float32", platform=platform, num_kv_blocks=64,
              max_num_batched_tokens=32)  # the 50-token prompt is prefilled in two chunks
    res = llm.generate(prompts, params, use_tqdm=False)
    name = llm.engine.platform.name
    result[name] = [list(r.outputs[0].token_ids) for r in res]
    result[name + "_backend"] = llm.engine.runner.backend.name
print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def example_run(example_env, tiny_models) -> dict:
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT, tiny_models["llama"]],
        env=example_env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_platforms_lists_example(example_run):
    info = example_run["platforms"]
    rows = {p["name"]: p for p in info["platforms"]}
    assert rows["example"]["available"] and rows["example"]["module"] == "paged_example.platform"
    assert info["selected"] == "example" and "PAGED_PLATFORM" in info["why"]
    for name in ("rocm", "xpu"):  # the in-tree plugins are listed, unavailable, with a reason
        if name in rows:
            assert not rows[name]["available"] and rows[name]["reason"]


def test_example_generates_like_cpu(example_run):
    assert example_run["example_backend"] == "example-gather"
    assert example_run["cpu_backend"] in ("cpu-native", "cpu-torch")
    assert example_run["example"] == example_run["cpu"]
    assert all(len(t) == 12 for t in example_run["example"])
