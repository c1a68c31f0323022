"""Fleet simulator (issue 12): routing policies over a heterogeneous fleet of replicas.

    python bench/fleet_sim.py [--quick] [--seed 0] [--points 9] [--warmup 10] [--measure 15]

A discrete-event simulation (heapq) of many `paged serve` replicas behind one router. Each
replica is a profile (bench/results/fleet-profiles.json, each figure with its source): a
continuous-batching server whose step holds the running decodes plus a prefill chunk within a
2048-token budget, and whose step time is

    t = t0 + k * decodes + sum over prefill chunks of n * c_lin + c_att * n * (start + n / 2)

(c_att: attention cost growing with the chunk's depth in the prompt). Prefix-cache hits skip
their prefill tokens; KV capacity (tokens) bounds what is admitted. Requests arrive as a
Poisson stream with long-tailed lengths, half of them opening with one of K shared documents
(Zipf popularity), so that where a request goes decides whether its prefix is cached.

Policies: round-robin; least-load (least outstanding tokens: prompt + expected output of the
requests in flight on each replica); prefix (the default): the replica expected to finish the
request soonest = queued prefill / its prefill rate + the request's uncached prefill + expected
output x its decode step time at its batch + 1, where "uncached" comes from the router's own
approximate per-replica record of the prompt blocks it sent there (16-token blocks; LRU bounded
by the replica's KV capacity, like SGLang's approximate radix tree per worker); never a replica
whose max context or KV capacity is too small for the request.

Goodput: for each fleet and policy, a sweep of arrival rates; a request meets the SLO when its
TTFT <= 1 s and its TPOT (time from first to last token / (output tokens - 1)) <= 50 ms; the
goodput is the highest swept rate at which >= 99 % of the requests that arrived in the
measured window meet both (so p99 TTFT <= 1 s and p99 TPOT <= 50 ms at once). Results:
bench/results/fleet.md, fleet-latest.json, fleet-goodput.png.
"""

from __future__ import annotations

import argparse
import datetime as dt
import heapq
import json
import math
import sys
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"


def git_rev() -> str:
    from common import git_rev  # bench/common.py: on sys.path when this runs as a script

    return git_rev()


def machine() -> str:
    from common import machine

    return machine()

BLOCK = 16
STEP_BUDGET = 2048
TTFT_SLO = 1.0
TPOT_SLO = 0.050
POLICIES = ("round-robin", "least-load", "prefix")

# --------------------------------------------------------------------------------------------
# Profiles
# --------------------------------------------------------------------------------------------

# Model shape (llama-3.1-8b): parameters, KV bytes per token (32 layers x 8 KV heads x 128 x 2
# (K, V) x 2 bytes), attention FLOPs per token per token of depth (QK^T and PV: 2 x 2 x 4096 x
# 32 layers) against the linear layers' 2 x 8.03e9.
PARAMS_8B = 8.03e9
KV_BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2
ATT_FLOPS_PER_DEPTH = 2 * 2 * 4096 * 32
LIN_FLOPS = 2 * PARAMS_8B
SMOLLM2_PARAMS = 1.345e8
GIB = 1024**3


def derive_profiles() -> dict:
    """Profiles from the measured figures of bench/results/h200.md and cpu.md (see `source`)."""
    # H200, llama-3.1-8b bf16 (bench/results/h200.md, 2026-12-03):
    t1 = 4.82e-3  # batch-1 decode ms/token (latency run, 06:16 UTC)
    ttft_32k = 1.5553  # 32,000-token prompt, 16 chunks, no prefix cache (14:30 UTC)
    t0 = t1  # per-step fixed cost, ~= batch-1 step; k added below is ~1 % of it at b = 1
    # 32k prompt: 16 steps of t0 + sum over tokens of c_lin (1 + depth * a), a = att/lin FLOPs
    a = ATT_FLOPS_PER_DEPTH / LIN_FLOPS
    c_lin = (ttft_32k - 16 * t0) / (32000 * (1 + a * 32000 / 2))
    c_att = c_lin * a
    # throughput run, 1000 x 256 in / 256 out at 27,352 total tok/s (06:19 UTC): 18.72 s =
    # steps x t0 + prefill(256k tokens at depth < 256) + k x decode tokens; ~1,060 steps
    # (256-way batch, 255k decode tokens, prefill chunks folded into decode steps)
    total = 1000 * 512 / 27352
    steps = 1060
    prefill = 1000 * (256 * c_lin + c_att * 256 * 128)
    k = (total - steps * t0 - prefill) / (1000 * 255)
    kv_h200 = 100 * GIB  # 139.8 GiB x 0.9 - 16 GB weights - activations, rounded down
    h200 = {
        "t0_s": t0 - k,
        "k_s": k,
        "c_lin_s": c_lin,
        "c_att_s": c_att,
        "kv_tokens": int(kv_h200 // KV_BYTES_PER_TOKEN),
        "max_context": 131072,
        "max_seqs": 256,
        "source": (
            "measured (bench/results/h200.md, llama-3.1-8b bf16 dummy weights, paged bench): "
            "t(1) = 4.82 ms/token (batch-1 decode); prefill cost per token c_lin and its "
            "attention term c_att fitted to the 32,000-token prompt's TTFT of 1555 ms (16 "
            "chunks) with the attention/linear FLOP ratio of the 8B shape (short prompts: "
            f"{1 / c_lin:.0f} tok/s, the 32k prompt: 20.6k tok/s); k (per extra decode) fitted "
            "to the 1000 x 256/256 throughput run (27,352 total tok/s) given that prefill "
            "model; KV: ~100 GiB at 128 KiB/token (derived, 0.9 of 139.8 GiB less weights)"
        ),
    }
    # MI300X-class: NOT measured. Spec-sheet ratios against H200: HBM 5.3 vs 4.8 TB/s (decode
    # step terms), dense bf16 1307 vs 989 TFLOP/s (prefill terms), 192 vs 141 GB.
    bw, fl = 4.8 / 5.3, 989 / 1307
    mi = {
        "t0_s": h200["t0_s"] * bw,
        "k_s": k * bw,
        "c_lin_s": c_lin * fl,
        "c_att_s": c_att * fl,
        "kv_tokens": int((178.8 * 0.9 - 15 - 11) * GIB // KV_BYTES_PER_TOKEN),
        "max_context": 131072,
        "max_seqs": 256,
        "source": (
            "NOT measured: the H200 profile scaled by published spec ratios (HBM bandwidth "
            "5.3/4.8 TB/s for the decode terms, dense bf16 1307/989 TFLOP/s for the prefill "
            "terms, 192/141 GB memory for KV); real MI300X software efficiency may be lower"
        ),
    }
    # CPU: SmolLM2-135M on 2 cores (bench/results/cpu.md 09:39 UTC, bf16): batch 1 74.3 tok/s,
    # 64 x 128 at 766.6 tok/s; prefill 4 x 128 tokens in 505 ms (tp-cpu.md, float32, TP=1).
    c1, c64 = 1 / 74.3, 64 / 766.6
    kc = (c64 - c1) / 63
    scale = PARAMS_8B / SMOLLM2_PARAMS
    cpu = {
        "t0_s": (c1 - kc) * scale,
        "k_s": kc * scale,
        "c_lin_s": 0.5054 / 512 * scale,
        "c_att_s": 0.0,
        "kv_tokens": int(8 * GIB // KV_BYTES_PER_TOKEN),
        "max_context": 32768,
        "max_seqs": 64,
        "source": (
            "what-if: measured for SmolLM2-135M on 2 EPYC cores (bench/results/cpu.md: batch-1 "
            "74.3 tok/s, batch-64 766.6 tok/s; tp-cpu.md: prefill 512 tokens in 505 ms), then "
            f"scaled to an 8B model by the weight-size ratio ({scale:.1f}x) on every term; KV 8 "
            "GiB of host memory (64k tokens), max context 32k (assumed)"
        ),
    }
    return {"H200": h200, "MI300X": mi, "CPU": cpu, "scale_cpu_to_8b": scale}


# --------------------------------------------------------------------------------------------
# Workload
# --------------------------------------------------------------------------------------------


@dataclass
class Workload:
    prompt_median: float = 600
    prompt_p99: float = 8000
    out_median: float = 150
    out_sigma: float = 0.8
    shared_frac: float = 0.5
    n_prefixes: int = 1000
    zipf_a: float = 1.1
    prefix_min: int = 1024
    prefix_max: int = 4096
    max_prompt: int = 120000
    max_out: int = 4096


@dataclass
class Request:
    rid: int
    arrival: float
    prompt: int
    out: int
    prefix_id: int  # -1: none
    prefix_blocks: int  # full 16-token blocks of the shared document in this prompt
    replica: int = -1
    cached: int = 0
    remaining: int = 0  # prefill tokens left
    done_prefill: int = 0
    first_token: float = -1.0
    finish: float = -1.0
    finish_step: int = 0
    private_blocks: int = 0


def make_requests(rate: float, duration: float, wl: Workload, rng: np.random.Generator):
    n = int(rng.poisson(rate * duration))
    arrivals = np.sort(rng.uniform(0, duration, n))
    sigma = math.log(wl.prompt_p99 / wl.prompt_median) / 2.326
    own = np.clip(rng.lognormal(math.log(wl.prompt_median), sigma, n), 4, wl.max_prompt)
    outs = np.clip(rng.lognormal(math.log(wl.out_median), wl.out_sigma, n), 1, wl.max_out)
    shared = rng.random(n) < wl.shared_frac
    ranks = np.arange(1, wl.n_prefixes + 1)
    p = ranks ** (-wl.zipf_a)
    pid = rng.choice(wl.n_prefixes, n, p=p / p.sum())
    plen_rng = np.random.default_rng(12345)  # document lengths: fixed per document
    doc_len = plen_rng.integers(wl.prefix_min, wl.prefix_max + 1, wl.n_prefixes)
    reqs = []
    for i in range(n):
        prompt, pref, pb = int(own[i]), -1, 0
        if shared[i]:
            pref = int(pid[i])
            prompt = min(prompt + int(doc_len[pref]), wl.max_prompt)
            pb = min(int(doc_len[pref]), prompt) // BLOCK
        reqs.append(Request(i, float(arrivals[i]), prompt, int(outs[i]), pref, pb))
    return reqs


# --------------------------------------------------------------------------------------------
# Replica
# --------------------------------------------------------------------------------------------


@dataclass
class Replica:
    idx: int
    kind: str
    t0: float
    k: float
    c_lin: float
    c_att: float
    kv_blocks: int
    max_context: int
    max_seqs: int
    waiting: deque = field(default_factory=deque)
    prefilling: list = field(default_factory=list)
    decode_heap: list = field(default_factory=list)
    step: int = 0
    busy: bool = False
    version: int = 0
    # macro step (decode-only stretch): start time, steps planned, step time
    m_start: float = 0.0
    m_steps: int = 0
    m_dt: float = 0.0
    m_prefill: bool = False
    private: int = 0  # blocks owned by running requests (not in the cache)
    cache: OrderedDict = field(default_factory=OrderedDict)  # prefix id -> cached blocks
    cache_size: int = 0
    pins: dict = field(default_factory=dict)  # prefix id -> running requests using it
    hit_tokens: int = 0
    prompt_tokens: int = 0

    def step_time(self, b: int, chunks: list[tuple[int, int]]) -> float:
        t = self.t0 + self.k * b
        for start, n in chunks:
            t += n * self.c_lin + self.c_att * n * (start + n / 2)
        return t

    def running(self) -> int:
        return len(self.decode_heap) + len(self.prefilling)

    def evict(self, need: int) -> bool:
        """Make room for `need` more private blocks; False if the pinned data leaves none."""
        while self.private + self.cache_size + need > self.kv_blocks:
            victim = None
            for key in self.cache:
                if not self.pins.get(key):
                    victim = key
                    break
            if victim is None:
                return False
            self.cache_size -= self.cache.pop(victim)
        return True

    def try_admit(self, r: Request) -> bool:
        if self.running() >= self.max_seqs:
            return False
        hit = 0
        if r.prefix_id >= 0 and r.prefix_id in self.cache:
            hit = min(self.cache[r.prefix_id], r.prefix_blocks)
            hit = min(hit * BLOCK, r.prompt - 1) // BLOCK
        need = -(-(r.prompt + r.out) // BLOCK) - hit
        if r.prefix_id >= 0:
            self.pins[r.prefix_id] = self.pins.get(r.prefix_id, 0) + 1  # keep hit blocks
        if not self.evict(need):
            if r.prefix_id >= 0:
                self.pins[r.prefix_id] -= 1
            return False
        if hit:
            self.cache.move_to_end(r.prefix_id)
        r.cached = hit * BLOCK
        r.remaining = r.prompt - r.cached
        r.done_prefill = r.cached
        r.private_blocks = need
        self.private += need
        self.hit_tokens += r.cached
        self.prompt_tokens += r.prompt
        return True

    def prefill_done(self, r: Request) -> None:
        """The request's prompt blocks of its shared document join the cache."""
        if r.prefix_id < 0:
            return
        have = self.cache.get(r.prefix_id, 0)
        if r.prefix_blocks > have:
            moved = r.prefix_blocks - have
            self.cache[r.prefix_id] = r.prefix_blocks
            self.cache_size += moved
            r.private_blocks -= moved
            self.private -= moved
        self.cache.move_to_end(r.prefix_id)

    def release(self, r: Request) -> None:
        self.private -= r.private_blocks
        if r.prefix_id >= 0:
            self.pins[r.prefix_id] -= 1


# --------------------------------------------------------------------------------------------
# Router
# --------------------------------------------------------------------------------------------


class Router:
    def __init__(self, policy: str, replicas: list[Replica], exp_out: float):
        self.policy = policy
        self.reps = replicas
        n = len(replicas)
        self.rr = 0
        self.t0 = np.array([r.t0 for r in replicas])
        self.k = np.array([r.k for r in replicas])
        self.c_lin = np.array([r.c_lin for r in replicas])
        self.max_ctx = np.array([r.max_context for r in replicas])
        self.kv_tok = np.array([r.kv_blocks * BLOCK for r in replicas])
        self.pending_prefill = np.zeros(n)  # tokens routed, not yet prefilled
        self.active = np.zeros(n)  # requests in flight
        self.outstanding = np.zeros(n)  # prompt + expected output tokens in flight
        self.exp_out = exp_out
        # approximate per-replica record of the shared-document blocks sent there (LRU)
        self.tree: list[OrderedDict] = [OrderedDict() for _ in replicas]
        self.tree_size = [0] * n
        self.tree_cap = [r.kv_blocks for r in replicas]
        self.holders: dict[int, set] = {}  # prefix id -> replicas whose record holds it

    def feasible(self, r: Request) -> np.ndarray:
        return (self.max_ctx >= r.prompt + r.out) & (self.kv_tok >= r.prompt + r.out)

    def choose(self, r: Request) -> int:
        ok = self.feasible(r)
        n = len(self.reps)
        if self.policy == "round-robin":
            for _ in range(n):
                i = self.rr
                self.rr = (self.rr + 1) % n
                if ok[i]:
                    return i
            raise RuntimeError("no replica can hold the request")
        if self.policy == "least-load":
            return int(np.argmin(np.where(ok, self.outstanding, np.inf)))
        # prefix: expected finish time minus the prefix-cache saving
        uncached = np.full(n, float(r.prompt))
        if r.prefix_id >= 0:
            for i in self.holders.get(r.prefix_id, ()):
                blocks = min(self.tree[i][r.prefix_id], r.prefix_blocks)
                uncached[i] -= blocks * BLOCK
        est = (self.pending_prefill + uncached) * self.c_lin + self.exp_out * (
            self.t0 + self.k * (self.active + 1)
        )
        return int(np.argmin(np.where(ok, est, np.inf)))

    def routed(self, i: int, r: Request) -> None:
        self.pending_prefill[i] += r.prompt
        self.active[i] += 1
        self.outstanding[i] += r.prompt + self.exp_out
        if r.prefix_id < 0:
            return
        tree = self.tree[i]
        have = tree.get(r.prefix_id, 0)
        if r.prefix_blocks > have:
            tree[r.prefix_id] = r.prefix_blocks
            self.tree_size[i] += r.prefix_blocks - have
            self.holders.setdefault(r.prefix_id, set()).add(i)
        if r.prefix_id in tree:
            tree.move_to_end(r.prefix_id)
        while self.tree_size[i] > self.tree_cap[i] and tree:
            key, blocks = tree.popitem(last=False)
            self.tree_size[i] -= blocks
            self.holders[key].discard(i)

    def prefilled(self, i: int, tokens: int) -> None:
        self.pending_prefill[i] -= tokens

    def finished(self, i: int, r: Request) -> None:
        self.active[i] -= 1
        self.outstanding[i] -= r.prompt + self.exp_out


# --------------------------------------------------------------------------------------------
# Simulation
# --------------------------------------------------------------------------------------------


def build_fleet(profiles: dict, counts: dict[str, int]) -> list[Replica]:
    reps = []
    for kind, count in counts.items():
        p = profiles[kind]
        for _ in range(count):
            reps.append(
                Replica(
                    len(reps),
                    kind,
                    p["t0_s"],
                    p["k_s"],
                    p["c_lin_s"],
                    p["c_att_s"],
                    p["kv_tokens"] // BLOCK,
                    p["max_context"],
                    p["max_seqs"],
                )
            )
    return reps


def simulate(reqs: list[Request], replicas: list[Replica], policy: str, exp_out: float):
    """Run every request to completion; fills in replica, cached, first_token, finish."""
    router = Router(policy, replicas, exp_out)
    events: list = []  # (time, seq, kind, payload)
    seq = 0
    for r in reqs:
        events.append((r.arrival, seq, 0, r.rid, 0))
        seq += 1
    heapq.heapify(events)

    def start_step(rep: Replica, now: float) -> None:
        nonlocal seq
        # admit waiting requests in order
        while rep.waiting and rep.try_admit(rep.waiting[0]):
            rep.prefilling.append(rep.waiting.popleft())
        b = len(rep.decode_heap)
        if not rep.prefilling and b == 0:
            rep.busy = False
            return
        rep.busy = True
        rep.version += 1
        if rep.prefilling:
            budget = STEP_BUDGET - b
            chunks = []
            plan = []
            for r in rep.prefilling:
                if budget <= 0:
                    break
                n = min(r.remaining, budget)
                chunks.append((r.done_prefill, n))
                plan.append((r, n))
                budget -= n
            dt_ = rep.step_time(b, chunks)
            rep.m_start, rep.m_steps, rep.m_dt, rep.m_prefill = now, 1, dt_, True
            rep.plan = plan
            heapq.heappush(events, (now + dt_, seq, 1, rep.idx, rep.version))
        else:
            n = rep.decode_heap[0][0] - rep.step
            dt_ = rep.step_time(b, [])
            rep.m_start, rep.m_steps, rep.m_dt, rep.m_prefill = now, n, dt_, False
            heapq.heappush(events, (now + n * dt_, seq, 1, rep.idx, rep.version))
        seq += 1

    def end_step(rep: Replica, now: float) -> None:
        rep.step += rep.m_steps
        if rep.m_prefill:
            still = []
            done = set()
            for r, n in rep.plan:
                r.remaining -= n
                r.done_prefill += n
                router.prefilled(rep.idx, n + (r.cached if r.done_prefill == r.prompt else 0))
                if r.remaining == 0:
                    done.add(r.rid)
                    r.first_token = now
                    rep.prefill_done(r)
                    if r.out <= 1:
                        r.finish = now
                        rep.release(r)
                        router.finished(rep.idx, r)
                    else:
                        heapq.heappush(rep.decode_heap, (rep.step + r.out - 1, r.rid, r))
            still = [r for r in rep.prefilling if r.rid not in done]
            rep.prefilling = still
        heap = rep.decode_heap
        while heap and heap[0][0] <= rep.step:
            _, _, r = heapq.heappop(heap)
            r.finish = now
            rep.release(r)
            router.finished(rep.idx, r)
        start_step(rep, now)

    while events:
        now, _, kind, a, ver = heapq.heappop(events)
        if kind == 0:
            r = reqs[a]
            i = router.choose(r)
            r.replica = i
            router.routed(i, r)
            rep = replicas[i]
            rep.waiting.append(r)
            if not rep.busy:
                start_step(rep, now)
            elif not rep.m_prefill and rep.m_steps > 1:
                # cut the decode-only stretch at the next step boundary
                done = int((now - rep.m_start) / rep.m_dt) + 1
                if done < rep.m_steps:
                    rep.m_steps = done
                    rep.version += 1
                    t = rep.m_start + done * rep.m_dt
                    heapq.heappush(events, (t, seq, 1, rep.idx, rep.version))
                    seq += 1
        else:
            rep = replicas[a]
            if ver == rep.version:
                end_step(rep, now)
    return reqs


def summarize(reqs: list[Request], t_from: float, t_to: float, replicas: list[Replica]):
    win = [r for r in reqs if t_from <= r.arrival < t_to]
    ttft = np.array([r.first_token - r.arrival for r in win])
    tpot = np.array([(r.finish - r.first_token) / (r.out - 1) if r.out > 1 else 0.0 for r in win])
    ok = (ttft <= TTFT_SLO) & (tpot <= TPOT_SLO)
    kinds = {}
    for r in win:
        kinds[replicas[r.replica].kind] = kinds.get(replicas[r.replica].kind, 0) + 1
    shared = [r for r in win if r.prefix_id >= 0]
    return {
        "requests": len(win),
        "attainment": float(ok.mean()) if len(win) else 1.0,
        "p50_ttft_s": float(np.percentile(ttft, 50)),
        "p99_ttft_s": float(np.percentile(ttft, 99)),
        "p99_tpot_ms": float(np.percentile(tpot, 99) * 1000),
        "hit_rate": sum(r.cached for r in win) / max(1, sum(r.prompt for r in win)),
        "shared_hit_rate": sum(r.cached for r in shared)
        / max(1, sum(r.prefix_blocks * BLOCK for r in shared)),
        "share_by_kind": {k: v / len(win) for k, v in sorted(kinds.items())},
    }


def run_point(profiles, counts, policy, rate, wl, warmup, measure, seed, exp_out, cooldown=5.0):
    """Arrivals for warmup + measure + cooldown seconds (the load goes on past the measured
    window); the requests that arrived in the window are measured, each run to completion."""
    rng = np.random.default_rng(seed)
    reqs = make_requests(rate, warmup + measure + cooldown, wl, rng)
    reps = build_fleet(profiles, counts)
    simulate(reqs, reps, policy, exp_out)
    out = summarize(reqs, warmup, warmup + measure, reps)
    out["rate"] = rate
    return out


def capacity_estimate(profiles: dict, counts: dict[str, int], wl: Workload) -> float:
    """Requests/s the GPUs could prefill + decode with no cache hits (sweep scale only)."""
    sigma = math.log(wl.prompt_p99 / wl.prompt_median) / 2.326
    prompt = wl.prompt_median * math.exp(sigma**2 / 2) + wl.shared_frac * (
        (wl.prefix_min + wl.prefix_max) / 2
    )
    out = wl.out_median * math.exp(wl.out_sigma**2 / 2)
    cap = 0.0
    for kind, n in counts.items():
        p = profiles[kind]
        per = prompt * p["c_lin_s"] + out * (p["t0_s"] / 64 + p["k_s"])  # ~64-way decode
        cap += n / per
    return cap


def goodput(points: list[dict]) -> float:
    ok = [p["rate"] for p in points if p["attainment"] >= 0.99]
    return max(ok) if ok else 0.0


def slo_throughput(points: list[dict]) -> float:
    return max(p["rate"] * p["attainment"] for p in points)


def run_all(args) -> dict:
    profiles = derive_profiles()
    wl = Workload()
    if args.quick:
        fleets = {
            "mixed": {"H200": 4, "MI300X": 4, "CPU": 16},
            "h200-only": {"H200": 8},
        }
    else:
        fleets = {
            "mixed": {"H200": 64, "MI300X": 64, "CPU": 256},
            "h200-only": {"H200": 128},
        }
    exp_out = wl.out_median * math.exp(wl.out_sigma**2 / 2)
    cap = capacity_estimate(profiles, fleets["h200-only"], wl)
    rates = [round(cap * f, 1) for f in np.linspace(0.4, 2.8, args.points)]
    results = {}
    for fname, counts in fleets.items():
        for policy in args.policies.split(","):

            def point(rate: float, fname=fname, counts=counts, policy=policy) -> dict:
                t = time.perf_counter()
                p = run_point(
                    profiles,
                    counts,
                    policy,
                    rate,
                    wl,
                    args.warmup,
                    args.measure,
                    args.seed,
                    exp_out,
                )
                p["wall_s"] = time.perf_counter() - t
                if args.verbose:
                    print(
                        f"{fname:9s} {policy:11s} {rate:8.1f}/s ok {p['attainment']:.4f} "
                        f"p99 ttft {p['p99_ttft_s']:.2f}s tpot {p['p99_tpot_ms']:.1f}ms "
                        f"hit {p['hit_rate']:.2f} {p['wall_s']:.1f}s",
                        flush=True,
                    )
                return p

            pts = [point(rate) for rate in rates]
            # refine: bisect between the highest passing swept rate and the next one up
            passing = [p["rate"] for p in pts if p["attainment"] >= 0.99]
            if passing and max(passing) < rates[-1]:
                lo = max(passing)
                hi = min(r for r in rates if r > lo)
                for _ in range(args.refine):
                    mid = round((lo + hi) / 2, 1)
                    p = point(mid)
                    pts.append(p)
                    lo, hi = (mid, hi) if p["attainment"] >= 0.99 else (lo, mid)
            pts.sort(key=lambda p: p["rate"])
            results.setdefault(fname, {})[policy] = {
                "goodput": goodput(pts),
                "slo_throughput": slo_throughput(pts),
                "points": pts,
            }
    return {
        "profiles": profiles,
        "workload": wl.__dict__,
        "fleets": fleets,
        "rates": rates,
        "results": results,
    }


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fleets = list(res["results"])
    fig, axes = plt.subplots(1, len(fleets), figsize=(6 * len(fleets), 4.2), squeeze=False)
    for ax, fname in zip(axes[0], fleets, strict=True):
        for policy, v in res["results"][fname].items():
            x = [p["rate"] for p in v["points"]]
            y = [p["rate"] * p["attainment"] for p in v["points"]]
            ax.plot(x, y, marker="o", label=f"{policy} (goodput {v['goodput']:.0f}/s)")
        ax.plot(x, x, color="grey", lw=0.6, ls=":", label="offered load")
        ax.set_title(f"{fname}: " + ", ".join(f"{n} {k}" for k, n in res["fleets"][fname].items()))
        ax.set_xlabel("arrival rate (requests/s)")
        ax.set_ylabel("requests/s meeting TTFT<=1s and TPOT<=50ms")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(res: dict, args, wall: float) -> None:
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    cmd = "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])
    wl = res["workload"]
    lines = [
        f"\n## Fleet simulation{' (--quick)' if args.quick else ''} ({now})\n",
        f"- machine: {machine()}",
        f"- commit: {git_rev()}",
        f"- command: `{cmd}` ({wall:.0f} s wall)",
        "- fleets: "
        + "; ".join(
            f"{f}: " + ", ".join(f"{n} {k}" for k, n in c.items()) for f, c in res["fleets"].items()
        ),
        f"- workload: Poisson arrivals; prompt lognormal median {wl['prompt_median']}, p99 "
        f"{wl['prompt_p99']} tokens; output lognormal median {wl['out_median']}, sigma "
        f"{wl['out_sigma']}; {wl['shared_frac']:.0%} of requests open with one of "
        f"{wl['n_prefixes']} documents of {wl['prefix_min']}-{wl['prefix_max']} tokens, Zipf "
        f"a={wl['zipf_a']}; seed {args.seed}; {args.warmup:g} s warm-up then {args.measure:g} s "
        "measured per point (arrivals go on 5 s past it); rates swept: "
        + ", ".join(f"{r:g}" for r in res["rates"])
        + " req/s",
        "- goodput: the highest rate run at which >= 99 % of the measured requests meet TTFT "
        "<= 1 s and TPOT <= 50 ms (p99 of both); SLO throughput: max over the sweep of rate x "
        "fraction meeting both (reads where goodput is 0); resolution: the sweep step / "
        f"2^{args.refine} (bisection between the highest passing swept rate and the next)",
        "",
        "| fleet | policy | goodput req/s | SLO throughput req/s | cache hit rate at goodput "
        "(prompt tokens / shared-document tokens) | share sent to CPU replicas at goodput "
        "(lowest rate if 0) |",
        "|---|---|---|---|---|---|",
    ]
    for fname, pol in res["results"].items():
        for policy, v in pol.items():
            pts = v["points"]
            at = [p for p in pts if p["rate"] == v["goodput"]] or [pts[0]]
            p = at[0]
            lines.append(
                f"| {fname} | {policy} | {v['goodput']:g} | {v['slo_throughput']:.0f} | "
                f"{p['hit_rate']:.1%} / {p['shared_hit_rate']:.1%} | "
                f"{p['share_by_kind'].get('CPU', 0):.1%} |"
            )
    lines += [
        "",
        "Per point (fleet, policy, rate: fraction meeting both SLOs, p99 TTFT s, p99 "
        "TPOT ms, hit rate):",
        "",
    ]
    for fname, pol in res["results"].items():
        for policy, v in pol.items():
            cells = ", ".join(
                f"{p['rate']:g}: {p['attainment']:.3f}/{p['p99_ttft_s']:.2f}/"
                f"{p['p99_tpot_ms']:.0f}/{p['hit_rate']:.2f}"
                for p in v["points"]
            )
            lines.append(f"- {fname} {policy}: {cells}")
    mixed = res["results"].get("mixed", {})
    if "prefix" in mixed and "round-robin" in mixed:
        g_p, g_r = mixed["prefix"]["goodput"], mixed["round-robin"]["goodput"]
        s_p, s_r = mixed["prefix"]["slo_throughput"], mixed["round-robin"]["slo_throughput"]
        ratio = f"{g_p / g_r:.2f}x" if g_r else "unbounded (round-robin 0)"
        verdict = "pass" if (g_r == 0 and g_p > 0) or (g_r and g_p / g_r >= 1.5) else "FAIL"
        lines.append("")
        lines.append(
            f"floor (mixed fleet, prefix >= 1.5x round-robin goodput): prefix {g_p:g} vs "
            f"round-robin {g_r:g} req/s: {ratio}: **{verdict}**; SLO throughput "
            f"{s_p:.0f} vs {s_r:.0f} ({s_p / max(s_r, 1e-9):.2f}x)"
        )
    ho = res["results"].get("h200-only", {})
    if "prefix" in ho and "round-robin" in ho and ho["round-robin"]["goodput"]:
        lines.append(
            f"h200-only fleet: prefix / round-robin goodput "
            f"{ho['prefix']['goodput'] / ho['round-robin']['goodput']:.2f}x"
        )
    lines.append("")
    lines.append("Profiles (bench/results/fleet-profiles.json):")
    lines.append("")
    for kind in ("H200", "MI300X", "CPU"):
        p = res["profiles"][kind]
        lines.append(
            f"- {kind}: t(b) = {p['t0_s'] * 1e3:.2f} + {p['k_s'] * 1e3:.4f} b ms; prefill "
            f"{1 / p['c_lin_s']:.0f} tok/s (short prompts); KV {p['kv_tokens']} tokens; "
            f"max context {p['max_context']}. {p['source']}"
        )
    md = RESULTS / "fleet.md"
    if not md.exists():
        md.write_text("# Fleet simulation (bench/fleet_sim.py)\n")
    with open(md, "a") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small fleet (8 GPUs + 16 CPUs)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--points", type=int, default=10, help="load points per policy")
    ap.add_argument("--warmup", type=float, default=None, help="seconds before measuring")
    ap.add_argument("--measure", type=float, default=None, help="seconds measured")
    ap.add_argument("--refine", type=int, default=2, help="bisection steps past the sweep")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--no-write", action="store_true", help="print only")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    if args.warmup is None:
        args.warmup = 10.0 if args.quick else 15.0
    if args.measure is None:
        args.measure = 20.0 if args.quick else 30.0
    t = time.perf_counter()
    res = run_all(args)
    wall = time.perf_counter() - t
    if args.no_write:
        for f, pol in res["results"].items():
            for p, v in pol.items():
                print(f, p, v["goodput"], round(v["slo_throughput"], 1))
        return
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / "fleet-profiles.json", "w") as f:
        json.dump(res["profiles"], f, indent=1)
    with open(RESULTS / "fleet-latest.json", "w") as f:
        json.dump(
            {
                "date": dt.datetime.now(dt.UTC).isoformat(),
                "machine": machine(),
                "commit": git_rev(),
                "argv": sys.argv,
                "wall_s": wall,
                **res,
            },
            f,
            indent=1,
        )
    plot(res, RESULTS / "fleet-goodput.png")
    report(res, args, wall)


if __name__ == "__main__":
    main()
