"""bench/fleet_sim.py: invariants of the fleet simulator on a small fleet (no timed assertions)."""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

# Loaded by path: bench/ is a directory of scripts, not a package on sys.path.
_spec = importlib.util.spec_from_file_location(
    "fleet_sim", Path(__file__).resolve().parents[1] / "bench" / "fleet_sim.py"
)
fs = importlib.util.module_from_spec(_spec)
sys.modules["fleet_sim"] = fs  # dataclasses look their module up by name
_spec.loader.exec_module(fs)

QUICK = {"H200": 4, "MI300X": 4, "CPU": 16}


def _run(policy: str, rate: float, wl: fs.Workload, counts=QUICK, duration: float = 20.0):
    profiles = fs.derive_profiles()
    reqs = fs.make_requests(rate, duration, wl, np.random.default_rng(0))
    reps = fs.build_fleet(profiles, counts)
    exp_out = wl.out_median * math.exp(wl.out_sigma**2 / 2)
    fs.simulate(reqs, reps, policy, exp_out)
    return reqs, reps


@pytest.mark.parametrize("policy", fs.POLICIES)
def test_every_request_finishes(policy):
    wl = fs.Workload()
    reqs, reps = _run(policy, 60.0, wl)
    assert len(reqs) > 500
    for r in reqs:
        assert 0 <= r.replica < len(reps)
        assert r.arrival <= r.first_token <= r.finish
        assert r.first_token - r.arrival <= r.finish - r.arrival  # TTFT <= e2e
        assert 0 <= r.cached < r.prompt
        assert r.prompt + r.out <= reps[r.replica].max_context
    # every replica drained: nothing running, no KV held
    for rep in reps:
        assert not rep.waiting and not rep.prefilling and not rep.decode_heap
        assert rep.private == 0
        assert all(v == 0 for v in rep.pins.values())
        assert rep.cache_size <= rep.kv_blocks


def test_prefix_policy_hits_cache_more_than_round_robin():
    wl = replace(fs.Workload(), shared_frac=0.9, n_prefixes=50)
    hits = {}
    for policy in ("round-robin", "prefix"):
        reqs, _ = _run(policy, 60.0, wl, counts={"H200": 8})
        hits[policy] = sum(r.cached for r in reqs) / sum(r.prompt for r in reqs)
    assert hits["prefix"] > hits["round-robin"]


def test_long_prompts_avoid_small_replicas():
    wl = replace(fs.Workload(), prompt_median=20000, prompt_p99=60000)
    reqs, reps = _run("prefix", 5.0, wl, duration=10.0)
    big = [r for r in reqs if r.prompt + r.out > 32768]
    assert big
    assert all(reps[r.replica].kind != "CPU" for r in big)
    reqs, reps = _run("round-robin", 5.0, wl, duration=10.0)
    assert all(reps[r.replica].kind != "CPU" for r in reqs if r.prompt + r.out > 32768)


def test_quick_sweep_reports_goodput():
    args = argparse.Namespace(
        quick=True,
        seed=0,
        points=3,
        refine=1,
        warmup=5.0,
        measure=10.0,
        policies="round-robin,prefix",
        verbose=False,
    )
    res = fs.run_all(args)
    for fleet in ("mixed", "h200-only"):
        for policy in ("round-robin", "prefix"):
            v = res["results"][fleet][policy]
            assert 3 <= len(v["points"]) <= 4  # the sweep + at most one bisection step
            assert v["goodput"] in [0.0, *(p["rate"] for p in v["points"])]
            assert 0 <= v["slo_throughput"] <= max(res["rates"])
            for p in v["points"]:
                assert 0.0 <= p["attainment"] <= 1.0
                assert 0.0 <= p["hit_rate"] <= 1.0
    for kind in ("H200", "MI300X", "CPU"):
        assert res["profiles"][kind]["source"]
