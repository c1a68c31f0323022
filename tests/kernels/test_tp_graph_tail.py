"""The decode graph's tail (LM head, the logits' gather, greedy argmax) with two
tensor-parallel ranks: gloo on CPU, the Triton backend interpreted, test_spec_graphs' replaying
graph runner installed as a platform plugin so that the spawned rank runs it too. Every rank
replays the graph with the gather inside (the driver tells the others which path each step
takes: a rank that ran the head eagerly instead would leave the gather unmatched). Greedy
tokens equal HF's (as one rank's do: test_graph_tail) and an eager engine's at two ranks;
sampled ones equal the eager engine's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

KERNELS = Path(__file__).resolve().parent

HOOKS = f"""
import sys

from paged.hookspecs import hookimpl


@hookimpl
def paged_platforms():
    for p in ({str(KERNELS.parent)!r}, {str(KERNELS)!r}):
        if p not in sys.path:
            sys.path.insert(0, p)
    from test_spec_graphs import TritonGraphsOnCpu

    return [TritonGraphsOnCpu]
"""

SCRIPT = """
import json, sys
import torch
from paged import LLM, SamplingParams

path = sys.argv[1]
g = torch.Generator().manual_seed(4)
prompts = [torch.randint(2, 320, (n,), generator=g).tolist() for n in (9, 30)]
kw = dict(dtype="float32", max_model_len=128, max_num_batched_tokens=64, num_kv_blocks=64,
          max_num_seqs=2, seed=3)
greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
sampled = [SamplingParams(temperature=0.9, top_p=0.9, max_tokens=6, ignore_eos=True),
           SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)]
out = {}
for name, eager in (("two", False), ("two_eager", True)):
    llm = LLM(path, enforce_eager=eager, tensor_parallel_size=2, **kw)
    runner = llm.engine.runner.step_runner
    res = {"platform": llm.engine.platform.name, "tails": sorted(getattr(runner, "tails", {})),
           "samplers": len(getattr(runner, "sample_graphs", {}))}
    res["greedy"] = [o.outputs[0].token_ids for o in
                     llm.generate(prompts, greedy, use_tqdm=False)]
    torch.manual_seed(3)
    res["sampled"] = [o.outputs[0].token_ids for o in
                      llm.generate(prompts, sampled, use_tqdm=False)]
    res["tail_replays"] = sum(g.replays for n, (g, _, _) in getattr(runner, "graphs", {}).items()
                              if n in getattr(runner, "tails", {}))
    llm.engine.kv.check_invariants()
    llm.engine.shutdown()
    out[name] = res
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def replay_site(tmp_path_factory) -> Path:
    """A site folder holding the replaying platform as an installed plugin."""
    site = tmp_path_factory.mktemp("replay-site")
    (site / "paged_replay_graphs.py").write_text(HOOKS)
    info = site / "paged_replay_graphs-0.0.dist-info"
    info.mkdir()
    meta = "Metadata-Version: 2.1\nName: paged-replay-graphs\nVersion: 0.0\n"
    (info / "METADATA").write_text(meta)
    (info / "entry_points.txt").write_text("[paged]\nreplay = paged_replay_graphs\n")
    return site


@pytest.mark.slow  # 25-40 s: two ranks of interpreted graphs on two cores, with the long checks
def test_head_in_graph_at_two_ranks(tiny_models, replay_site, interpreter_only):
    from test_hf_parity import hf_greedy
    from transformers import AutoModelForCausalLM

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(replay_site), os.environ.get(
        "PYTHONPATH", "")]), PAGED_PLATFORM="triton-graphs-on-cpu", TRITON_INTERPRET="1",
        HF_HUB_OFFLINE="1")  # fmt: skip
    env.pop("PAGED_PLUGINS", None)
    path = tiny_models["llama"]
    proc = subprocess.run([sys.executable, "-c", SCRIPT, path], env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT ") :])
    two, eager = out["two"], out["two_eager"]
    assert two["platform"] == eager["platform"] == "triton-graphs-on-cpu"
    assert two["tails"] == [1, 2] and eager["tails"] == []
    assert two["tail_replays"] == 2 * 5  # greedy and sampled: five decode steps each
    assert two["samplers"] == 4  # the driver's sampler graphs
    assert two["greedy"] == eager["greedy"]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval()
    import torch

    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(2, 320, (n,), generator=g).tolist() for n in (9, 30)]
    assert two["greedy"] == [hf_greedy(hf, p, 6) for p in prompts]
    assert two["sampled"] == eager["sampled"]  # the same draw as the eager sampler
    assert two["sampled"][1] == two["greedy"][1]  # its greedy row
