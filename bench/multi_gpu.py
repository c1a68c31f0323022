"""Issue 17's multi-GPU figures in one device call: tensor-parallel correctness and speed, data
parallel against tensor parallel, a 70B shape at TP=4 and TP=8, a fleet of mixed replicas.

    python bench/multi_gpu.py                     # the phases the GPUs allow, in --budget (540 s)
    python bench/multi_gpu.py --phases 70b,fleet  # 4 or 8 GPUs: the phases needing more than 2
    python bench/multi_gpu.py --cpu-smoke --out /tmp/mg   # correctness on CPU (gloo), tiny models

Phases (in the order given, each in subprocesses with timeouts, so one failure or hang loses
nothing else; a phase needing more GPUs than torch sees is recorded as skipped):

- ``correctness`` (2 GPUs): a random ~1B Llama (as bench/gpu_check.py builds it) and the
  Qwen3-MoE test shape (tests/test_models_qwen3_moe.py's), float32, greedy tokens at TP=2
  against TP=1, CUDA graphs on (``graphs``) and off (``eager``), one engine per subprocess. A
  divergence is reported with TP=1's top-2 logprob gap there: a near-tie below --tie-gap.
- ``latency``: `paged bench latency`, batch 1, at each of --tps (floor: TP=2 <= 0.65 x TP=1).
- ``throughput``: `paged bench throughput`, 1000 x 256/256, at each of --tps.
- ``serve`` (2 GPUs): `paged serve --tensor-parallel-size 2`, then `paged bench serve` at
  --serve-rate (16/s, 512 in / 128 out) and a burst of the throughput workload sent at once.
- ``dp`` (2 GPUs): the same two loads on `paged serve --data-parallel-size 2`; the report says
  which of TP=2 and DP=2 wins each, and by how much.
- ``70b`` (4 GPUs): the Llama-3.1-70B shape (dummy weights) at each of --big-tps that fits:
  batch-1 decode and `paged bench throughput` (--big-prompts).
- ``fleet`` (4 GPUs): `paged serve --fleet` with one TP=2 group and two TP=1 replicas, the same
  two loads, requests per replica from GET /fleet.

NVLink multicast stays off in every child (NCCL_NVLS_ENABLE=0 and its PyTorch and NVSHMEM
twins). Results: $OUT/multi_gpu.md (a markdown section, also appended to bench/results/h200.md
unless --no-append or --cpu-smoke), $OUT/multi_gpu.json, logs in $OUT/logs/. The subprocess,
server and report helpers are bench/h200.py's.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import os
import random
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import h200 as H  # bench/h200.py and bench/common.py: on sys.path when this runs as a script
from common import machine

PHASES = ("correctness", "latency", "throughput", "serve", "dp", "70b", "fleet")
RESERVE_S = 15  # kept back from the budget to write the results
FLOOR_TP2_RATIO = 0.65  # issue 17: TP=2 batch-1 decode at most 0.65 x TP=1's, same run
MULTICAST_OFF = {  # NVLink multicast can put a shared host's GPUs out of service: never on
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
# The tests' tiny models (tests/tiny_hf.py, tests/test_models_qwen3_moe.py).
_TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=320, max_position_embeddings=512, eos_token_id=1,
             bos_token_id=0)  # fmt: skip
TINY_LLAMA = dict(_TINY, intermediate_size=128)
MOE_TEST = dict(_TINY, intermediate_size=96, moe_intermediate_size=48, num_experts=6,
                num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0],
                head_dim=16)  # fmt: skip
# Prompt lengths of the correctness check (the Llama's are gpu_check's).
PROMPT_LENS = {"llama": (5, 17, 64, 100, 129, 200, 300, 513), "qwen3_moe": (3, 17, 42, 70, 120)}
SMOKE_LENS = {"llama": (5, 17, 40, 70), "qwen3_moe": (3, 17, 42, 70)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    a = ap.add_argument
    a("--out", default=os.environ.get("OUT") or "/tmp/paged-multi-gpu", help="output folder")
    a("--phases", default=",".join(PHASES), help=f"comma list, in order, of {', '.join(PHASES)}")
    a("--budget", type=float, default=540, help="seconds for everything; later phases get less")
    a("--no-append", action="store_true", help="do not append to bench/results/h200.md")
    a("--cpu-smoke", action="store_true", help="correctness only, on CPU, tiny models, eager")
    a("--model", default="llama-3.1-8b", help="named shape (dummy weights) of the speed phases")
    a("--dtype", default="bfloat16", help="dtype of the speed phases")
    a("--engine-args", default="", help="extra paged engine flags of the speed phases")
    a("--tps", default="1,2", help="latency and throughput: tensor-parallel sizes")
    a("--corr-models", default="llama,qwen3_moe")
    a("--corr-variants", default="graphs,eager", help="graphs (CUDA graphs on), eager (off)")
    a("--corr-layers", type=int, default=16, help="layers of the random Llama (16: 1.24B)")
    a("--corr-new-tokens", type=int, default=32)
    a("--tie-gap", type=float, default=1e-3, help="a divergence below this top-2 gap: near-tie")
    a("--lat-input", type=int, default=128)
    a("--lat-output", type=int, default=64)
    a("--lat-iters", type=int, default=3)
    a("--tp-prompts", type=int, default=1000)
    a("--tp-input", type=int, default=256)
    a("--tp-output", type=int, default=256)
    a("--serve-rate", type=float, default=16.0, help="serve, dp: requests per second")
    a("--serve-prompts", type=int, default=240)
    a("--serve-input", type=int, default=512)
    a("--serve-output", type=int, default=128)
    a("--serve-max-model-len", type=int, default=2048)
    a("--burst-prompts", type=int, default=1000,
      help="serve, dp, fleet: --tp-input/--tp-output prompts sent at once (0: none)")  # fmt: skip
    a("--big-model", default="llama-3.1-70b", help="70b: llama-3.1-70b, a named shape or a path")
    a("--big-tps", default="4,8", help="70b: tensor-parallel sizes (those that fit run)")
    a("--big-prompts", type=int, default=200, help="70b: throughput prompts (--tp-input/output)")
    a("--fleet-rate", type=float, default=16.0, help="fleet: requests per second")
    a("--fleet-platform", default="cuda", help="fleet: the replicas' platform")
    a("--gpus", type=int, default=None, help="GPUs to plan for (default: torch's count)")
    for name, t in (("correctness", 220), ("latency", 130), ("throughput", 140), ("serve", 150),
                    ("dp", 150), ("70b", 420), ("fleet", 200)):  # fmt: skip
        a(f"--{name}-timeout", type=float, default=t, help="seconds")
    a("--_facts", default=None, help=argparse.SUPPRESS)  # internal: the machine-facts child
    a("--_build", default=None, help=argparse.SUPPRESS)  # internal: the model-building child
    a("--_engine", default=None, help=argparse.SUPPRESS)  # internal: one correctness engine
    args = ap.parse_args(argv)
    if args.cpu_smoke:  # the CPU has no graphs; fewer tokens
        args.phases, args.corr_variants, args.corr_new_tokens = "correctness", "eager", 16
    return args


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _names(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


@dataclass
class Ctx:
    out: Path
    smoke: bool
    gpus: int = 0

    @property
    def logs(self) -> Path:
        return self.out / "logs"


# ---- children: subprocesses of this script ----------------------------------------------
def child_facts(path: str) -> None:
    """GPU count, name and memory, versions and the GPU topology."""
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    facts: dict = {"gpus": n, "torch": torch.__version__, "cuda": torch.version.cuda}
    if n:
        facts["gpu"] = torch.cuda.get_device_name(0)
        facts["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30)
        try:
            topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True)
            facts["topology"] = topo.stdout
        except OSError:
            pass
    for mod in ("triton", "transformers"):
        try:
            facts[mod] = __import__(mod).__version__
        except ImportError:
            facts[mod] = None
    Path(path).write_text(json.dumps(facts, indent=1))


def _spread(model) -> None:
    """As the tests: matrices from N(0, 0.2), norms from U(0.5, 1.5): logits far from ties."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)


def child_build(root: str, layers: int, smoke: bool) -> None:
    """root/llama: a random ~1B Llama as gpu_check builds it (the tests' tiny one with
    --cpu-smoke); root/qwen3_moe: the tests' Qwen3-MoE shape; root/models.json: their sizes."""
    import torch
    import transformers as tf

    from paged.model.shapes import SHAPES

    if smoke:
        llama = tf.LlamaConfig(**TINY_LLAMA)
    else:
        shape = dict(SHAPES["llama-3.2-1b"], max_position_embeddings=16384)
        llama = tf.LlamaConfig(**(shape | {"num_hidden_layers": layers}))
    llama.architectures = ["LlamaForCausalLM"]
    on_gpu = torch.cuda.is_available() and not smoke
    info = {}
    for name, cfg in (("llama", llama), ("qwen3_moe", tf.Qwen3MoeConfig(**MOE_TEST))):
        torch.manual_seed(0)
        with torch.device("cuda" if on_gpu and name == "llama" else "cpu"):
            model = tf.AutoModelForCausalLM.from_config(cfg).float().eval()
        if smoke or name == "qwen3_moe":  # the 1B Llama keeps its init, as in gpu_check
            _spread(model)
        model.save_pretrained(os.path.join(root, name), safe_serialization=True)
        params = sum(p.numel() for p in model.parameters())
        info[name] = {"params": params, "vocab_size": cfg.vocab_size}
        del model
    Path(root, "models.json").write_text(json.dumps(info, indent=1))


def child_engine(spec_path: str) -> None:
    """One engine of spec (model, kwargs, prompts, max_tokens): its greedy tokens and the
    top-2 logprobs at each position, written to spec["out"]."""
    from paged import LLM, SamplingParams

    spec = json.loads(Path(spec_path).read_text())
    t0 = time.perf_counter()
    llm = LLM(spec["model"], **spec["kwargs"])
    load_s, t0 = time.perf_counter() - t0, time.perf_counter()
    try:
        greedy = SamplingParams(
            temperature=0, max_tokens=spec["max_tokens"], ignore_eos=True, logprobs=2
        )
        prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
        outs = [o.outputs[0] for o in llm.generate(prompts, greedy, use_tqdm=False)]
    finally:
        llm.engine.shutdown()
    top2 = [[_top2(pos) for pos in c.logprobs] for c in outs]
    res = {"tokens": [list(c.token_ids) for c in outs], "top2": top2, "load_s": round(load_s, 2)}
    res["generate_s"] = round(time.perf_counter() - t0, 3)
    Path(spec["out"]).write_text(json.dumps(res))


def _top2(pos: dict) -> list[float]:
    return sorted((getattr(v, "logprob", v) for v in pos.values()), reverse=True)[:2]


# ---- helpers -----------------------------------------------------------------------------
def _run(ctx: Ctx, name: str, cmd: list, deadline: float, cap: float = 1e9, echo: int = 30):
    """h200.run (log, heartbeat, timeout) with the time left before deadline, at most cap."""
    left = min(deadline - time.monotonic(), cap)
    return H.run(name, [str(c) for c in cmd], max(5.0, left), ctx.logs, echo)


def _keep(d: dict) -> dict:
    """A bench JSON without its argument dump and per-request rows."""
    return {k: v for k, v in d.items() if k not in ("args", "requests")}


def _fresh(path: Path) -> Path:
    """path, with what an earlier run into the same --out left there removed."""
    path.unlink(missing_ok=True)
    return path


def _model_flags(model: str, dtype: str, tp: int, engine_args: str, dummy: bool = False) -> list:
    """A speed run's engine flags: named shapes (and dummy=True) on dummy weights."""
    load = ["--load-format", "dummy"] if dummy or H._shape(model) else []
    return ["--model", model, *load, "--dtype", dtype, "--tensor-parallel-size", tp,
            *shlex.split(engine_args)]  # fmt: skip


@functools.cache
def _shape_dir(model: str) -> str:
    """A servable directory for a named shape (h200.shape_dir: config, word-level tokenizer)."""
    path = Path(tempfile.gettempdir()) / "paged-h200-shape" / model
    return H.shape_dir(model, path) if H._shape(model) else model


def _get_json(url: str) -> dict:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.loads(r.read().decode())
    except (OSError, ValueError):
        return {}


def _replica_tokens(port: int) -> dict[int, int]:
    """{replica index: prompt tokens it received so far}, from GET /fleet."""
    rows = _get_json(f"http://127.0.0.1:{port}/fleet").get("replicas") or []
    return {r["index"]: r.get("prompt_tokens") or 0 for r in rows}


# ---- correctness -------------------------------------------------------------------------
def _prompts(model: str, vocab: int, smoke: bool) -> list[list[int]]:
    rng = random.Random(1)
    lens = (SMOKE_LENS if smoke else PROMPT_LENS)[model]
    return [[rng.randrange(2, vocab) for _ in range(n)] for n in lens]


def _engine_kwargs(model: str, tp: int, eager: bool, smoke: bool) -> dict:
    kw: dict = {"dtype": "float32", "tensor_parallel_size": tp, "enforce_eager": eager}
    if smoke:
        return kw | {"platform": "cpu", "max_model_len": 256, "kv_cache_memory": "16MiB"}
    max_len = 2048 if model == "llama" else 256
    return kw | {"max_model_len": max_len, "gpu_memory_utilization": 0.5, "max_num_seqs": 64}


def compare(ref: dict, got: dict, tie_gap: float) -> dict:
    """Per prompt: identical, or the first divergence and TP=1's top-2 logprob gap there."""
    if "tokens" not in ref or "tokens" not in got:
        return {"error": "an engine failed (see logs/)", "passed": False}
    rows = []
    for i, (r, g) in enumerate(zip(ref["tokens"], got["tokens"], strict=True)):
        if r == g:
            rows.append({"prompt": i, "identical": True})
            continue
        j = next((k for k, (x, y) in enumerate(zip(r, g)) if x != y), min(len(r), len(g)))
        top = ref["top2"][i][j] if j < len(ref["top2"][i]) else []
        gap = top[0] - top[1] if len(top) == 2 else None
        near = gap is not None and gap < tie_gap
        rows.append({"prompt": i, "identical": False, "first_diff": j, "tp1_top2_gap": gap,
                     "near_tie": near})  # fmt: skip
    same = sum(r["identical"] for r in rows)
    return {
        "identical": f"{same}/{len(rows)}",
        "passed": all(r["identical"] or r["near_tie"] for r in rows),
        "prompts": rows,
        "load_s": {"tp1": ref.get("load_s"), "tp2": got.get("load_s")},
    }


def phase_correctness(args, ctx: Ctx, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    root = Path(tempfile.mkdtemp(prefix="paged-multi-gpu-models-"))
    build = [sys.executable, __file__, "--_build", root, "--corr-layers", args.corr_layers]
    build += ["--cpu-smoke"] if ctx.smoke else []
    res: dict = {"commands": [shlex.join(map(str, build))], "models": {}}
    try:
        res["build_rc"] = _run(ctx, "build", build, deadline, cap=150)
        res["model_info"] = info = H._load(root / "models.json")
        for model in _names(args.corr_models):
            if model not in info:
                res["models"][model] = {"-": {"error": "not built (logs/build.log)"}}
                continue
            prompts = _prompts(model, info[model]["vocab_size"], ctx.smoke)
            for variant in _names(args.corr_variants):
                outs = [_engine(ctx, model, root, variant, tp, prompts, args, deadline)
                        for tp in (1, 2)]  # fmt: skip
                cmp = res["models"].setdefault(model, {})[variant] = compare(*outs, args.tie_gap)
                same = cmp.get("identical", "n/a")
                print(f"[correctness] {model} {variant}: TP=2 = TP=1 {same}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    runs = [v for m in res["models"].values() for v in m.values()]
    res["passed"] = bool(runs) and all(v.get("passed") for v in runs)
    return res


def _engine(ctx: Ctx, model: str, root: Path, variant: str, tp: int, prompts: list, args,
            deadline: float) -> dict:  # fmt: skip
    """One correctness engine in a child: its output ({} if it failed)."""
    name = f"corr-{model}-{variant}-tp{tp}"
    spec = {"model": str(root / model), "prompts": prompts, "max_tokens": args.corr_new_tokens,
            "kwargs": _engine_kwargs(model, tp, variant == "eager", ctx.smoke),
            "out": str(_fresh(ctx.out / f"{name}.json"))}  # fmt: skip
    path = ctx.out / f"{name}-spec.json"
    path.write_text(json.dumps(spec))
    rc = _run(ctx, name, [sys.executable, __file__, "--_engine", path], deadline, echo=6)
    return H._load(Path(spec["out"])) if rc == 0 else {}


# ---- latency and throughput: the offline benches -----------------------------------------
def _latency(ctx: Ctx, name: str, flags: list, args, deadline: float) -> dict:
    path = _fresh(ctx.out / f"{name}.json")
    cmd = H.paged("bench", "latency", *flags, "--batch-size", 1, "--input-len", args.lat_input,
                  "--output-len", args.lat_output, "--no-enable-prefix-caching",
                  "--num-iters-warmup", 1, "--num-iters", args.lat_iters, "--save-json", path,
                  "--disable-tqdm")  # fmt: skip
    rc = _run(ctx, name, cmd, deadline)
    return {"rc": rc, "command": shlex.join(cmd), **_keep(H._load(path))}


def _throughput(ctx: Ctx, name: str, flags: list, args, prompts: int, deadline: float) -> dict:
    path = _fresh(ctx.out / f"{name}.json")
    cmd = H.paged("bench", "throughput", *flags, "--num-prompts", prompts,
                  "--input-len", args.tp_input, "--output-len", args.tp_output,
                  "--save-json", path, "--disable-tqdm")  # fmt: skip
    rc = _run(ctx, name, cmd, deadline)
    return {"rc": rc, "command": shlex.join(cmd), **_keep(H._load(path))}


def _per_tp(args, ctx: Ctx, timeout: float, bench) -> dict:
    """bench(ctx, tp, flags, deadline) at each of --tps that the GPUs allow."""
    deadline, res = time.monotonic() + timeout, {}
    for tp in _ints(args.tps):
        if tp > ctx.gpus:
            res[f"tp{tp}"] = {"skipped": f"needs {tp} GPUs"}
            continue
        res[f"tp{tp}"] = bench(ctx, tp, _model_flags(args.model, args.dtype, tp, args.engine_args),
                               deadline)  # fmt: skip
    return res


def phase_latency(args, ctx: Ctx, timeout: float) -> dict:
    run = lambda c, tp, flags, d: _latency(c, f"latency-tp{tp}", flags, args, d)
    res = _per_tp(args, ctx, timeout, run)
    one, two = res.get("tp1", {}).get("mean_tpot_ms"), res.get("tp2", {}).get("mean_tpot_ms")
    if one and two:
        res["tp2_over_tp1"] = two / one
        res["passed"] = two / one <= FLOOR_TP2_RATIO
    return res


def phase_throughput(args, ctx: Ctx, timeout: float) -> dict:
    run = lambda c, tp, flags, d: _throughput(c, f"throughput-tp{tp}", flags, args,
                                              args.tp_prompts, d)  # fmt: skip
    res = _per_tp(args, ctx, timeout, run)
    one = res.get("tp1", {}).get("total_tokens_per_s")
    two = res.get("tp2", {}).get("total_tokens_per_s")
    if one and two:
        res["tp2_over_tp1"] = two / one
    return res


# ---- serving: TP=2, DP=2, the fleet ------------------------------------------------------
def _loads(args, rate: float) -> list[tuple[str, list]]:
    """(name, `paged bench serve` flags): the paced serving load and the throughput burst."""
    out = [("rate", ["--request-rate", rate, "--num-prompts", args.serve_prompts,
                     "--random-input-len", args.serve_input,
                     "--random-output-len", args.serve_output])]  # fmt: skip
    if args.burst_prompts:
        out.append(("burst", ["--num-prompts", args.burst_prompts, "--random-input-len",
                              args.tp_input, "--random-output-len", args.tp_output]))  # fmt: skip
    return out


def _serve(args, ctx: Ctx, name: str, serve: list, port: int, timeout: float, rate: float) -> dict:
    """Start `serve`, wait for /health, run the loads (noting each replica's requests from GET
    /fleet), stop it. An error is recorded beside what was measured before it."""
    t0, serve = time.monotonic(), [str(c) for c in serve]
    deadline, url = t0 + timeout, f"http://127.0.0.1:{port}"
    res: dict = {"commands": [shlex.join(serve)]}
    print(f"[{name}] $ {shlex.join(serve)}", flush=True)
    with open(ctx.logs / f"{name}-server.log", "w") as f:
        server = subprocess.Popen(serve, stdout=f, stderr=subprocess.STDOUT, cwd=H.ROOT,
                                  env=H._env(), start_new_session=True)  # fmt: skip
    try:
        while not H._healthy(f"{url}/health"):
            if server.poll() is not None:
                raise RuntimeError(f"paged serve exited {server.returncode} ({name}-server.log)")
            if time.monotonic() - t0 > timeout * 0.6:
                raise TimeoutError(f"paged serve not healthy in time ({name}-server.log)")
            time.sleep(1)
        res["server_ready_s"] = round(time.monotonic() - t0, 1)
        print(f"[{name}] healthy after {res['server_ready_s']:.0f} s", flush=True)
        base = ["--url", f"{url}/v1", "--disable-tqdm"]
        if H._shape(args.model):  # a word-level tokenizer: random token ids
            base += ["--vocab-size", H._shape(args.model)["vocab_size"]]
        warm = [*base, "--num-prompts", 8, "--random-input-len", 64, "--random-output-len", 8]
        _run(ctx, f"{name}-warmup", H.paged("bench", "serve", *warm), deadline, cap=60, echo=3)
        for load, flags in _loads(args, rate):
            path = _fresh(ctx.out / f"{name}-{load}.json")
            cmd = H.paged("bench", "serve", *base, *flags, "--save-json", path)
            res["commands"].append(shlex.join(cmd))
            before, hist = _replica_tokens(port), H._histograms(f"{url}/metrics")
            rc = _run(ctx, f"{name}-{load}", cmd, deadline - 10)
            res[load] = {"rc": rc, **_keep(H._load(path))}
            res[load]["server_side_mean_ms"] = H._means(hist, H._histograms(f"{url}/metrics"))
            after, n_in = _replica_tokens(port), flags[flags.index("--random-input-len") + 1]
            res[load]["requests_per_replica"] = {
                str(i): round((n - before.get(i, 0)) / n_in) for i, n in after.items()
            }
        res["fleet"] = _get_json(f"{url}/fleet")
    except Exception as e:  # keep what was measured
        res["error"] = f"{type(e).__name__}: {e}"
        print(f"[{name}] failed: {res['error']}", flush=True)
    finally:
        H._stop(server)
    return res


def _serve_phase(args, ctx: Ctx, name: str, timeout: float, *flags: object) -> dict:
    model, port = _shape_dir(args.model), H._free_port()
    dummy = ["--load-format", "dummy"] if H._shape(args.model) else []
    cmd = H.paged("serve", model, *dummy, "--dtype", args.dtype, *flags, "--max-model-len",
                  args.serve_max_model_len, "--served-model-name", args.model,
                  *shlex.split(args.engine_args), "--port", port)  # fmt: skip
    return _serve(args, ctx, name, cmd, port, timeout, args.serve_rate)


def phase_serve(args, ctx: Ctx, timeout: float) -> dict:
    return _serve_phase(args, ctx, "serve-tp2", timeout, "--tensor-parallel-size", 2)


def phase_dp(args, ctx: Ctx, timeout: float) -> dict:
    return _serve_phase(args, ctx, "serve-dp2", timeout, "--data-parallel-size", 2)


def fleet_file(args, path: Path) -> Path:
    """One TP=2 group and two TP=1 replicas of --model (docs/fleet.md)."""
    import yaml

    engine = {"dtype": args.dtype, "max_model_len": args.serve_max_model_len}
    if H._shape(args.model):
        engine["load_format"] = "dummy"
    fleet = {
        "model": _shape_dir(args.model),
        "args": engine,
        "replicas": [
            {"platform": args.fleet_platform, "count": 1, "args": {"tensor_parallel_size": 2}},
            {"platform": args.fleet_platform, "count": 2},
        ],
    }
    path.write_text(yaml.safe_dump(fleet, sort_keys=False))
    return path


def phase_fleet(args, ctx: Ctx, timeout: float) -> dict:
    path, port = fleet_file(args, ctx.out / "fleet.yaml"), H._free_port()
    cmd = H.paged("serve", "--fleet", path, "--served-model-name", args.model,
                  *shlex.split(args.engine_args), "--port", port)  # fmt: skip
    res = _serve(args, ctx, "serve-fleet", cmd, port, timeout, args.fleet_rate)
    return {"fleet_file": path.read_text(), **res}


# ---- the 70B shape -----------------------------------------------------------------------
def phase_70b(args, ctx: Ctx, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    model = args.big_model
    res: dict = {"model": model}
    for tp in _ints(args.big_tps):
        if tp > ctx.gpus:
            res[f"tp{tp}"] = {"skipped": f"needs {tp} GPUs"}
            continue
        flags = _model_flags(model, args.dtype, tp, args.engine_args, dummy=True)
        lat = _latency(ctx, f"70b-latency-tp{tp}", flags, args, deadline)
        thr = _throughput(ctx, f"70b-throughput-tp{tp}", flags, args, args.big_prompts, deadline)
        res[f"tp{tp}"] = {"latency": lat, "throughput": thr}
    return res


RUNNERS = {
    "correctness": phase_correctness,
    "latency": phase_latency,
    "throughput": phase_throughput,
    "serve": phase_serve,
    "dp": phase_dp,
    "70b": phase_70b,
    "fleet": phase_fleet,
}


def needs(phase: str, args) -> int:
    """GPUs a phase needs at least (its parts needing more skip themselves)."""
    fixed = {"correctness": 2, "serve": 2, "dp": 2, "fleet": 4}
    return fixed.get(phase) or min(_ints(args.big_tps if phase == "70b" else args.tps))


# ---- the report --------------------------------------------------------------------------
_f, _ok = H._f, H._ok


def _cmds(*cmds: str | None) -> list[str]:
    """Command lines as markdown paragraphs, `paged ...` as the bench JSONs write them."""
    paged = shlex.join(H.paged())
    return [f"\n`{c.replace(paged, 'paged').replace(sys.executable, 'python')}`" for c in cmds if c]


def _failed(x: dict) -> str:
    return x.get("skipped") or x.get("error") or f"failed: exit {x.get('rc')} (see logs/)"


def report(args, facts: dict, res: dict, started: str) -> str:
    where = f"{facts.get('gpu', 'no GPU')} x {facts.get('gpus', 0)}"
    if args.gpus is not None:
        where += f" (planned for {args.gpus} by --gpus)"
    if args.cpu_smoke:
        where = f"CPU smoke test ({machine()})"
    vers = ", ".join(f"{k} {facts[k]}" for k in ("torch", "triton", "transformers") if facts.get(k))
    lines = [
        f"\n## {where}: tensor and data parallel, issue 17 ({started})\n",
        f"- versions: {vers or 'n/a'}; commit {H._git_rev()}; budget {args.budget:.0f} s; "
        + ("gloo" if args.cpu_smoke else "NCCL, NVLink multicast off (NCCL_NVLS_ENABLE=0)"),
        f"- command: `python {shlex.join(['bench/multi_gpu.py', *sys.argv[1:]])}`",
    ]
    sections = (("correctness", _correctness_md), ("latency", _latency_md),
                ("throughput", _throughput_md), ("dp", _dp_md), ("70b", _big_md),
                ("fleet", _fleet_md))  # fmt: skip
    for phase, md in sections:
        ran = [res.get(p, {}) for p in (("serve", "dp") if phase == "dp" else (phase,))]
        if any(r and not r.get("skipped") for r in ran):
            lines += md(args, res)
    for k, v in res.items():
        if v.get("skipped") or v.get("error"):
            lines.append(f"- {k}: {v.get('skipped') or v.get('error')}")
    return "\n".join(lines) + "\n"


def _correctness_md(args, res: dict) -> list[str]:
    c, info = res["correctness"], res["correctness"].get("model_info", {})
    out = [
        f"\n### Correctness: float32 greedy, TP=2 against TP=1, {args.corr_new_tokens} tokens\n",
        "| model | CUDA graphs | identical | divergences: prompt @ token (TP=1 top-2 gap) | |",
        "|---|---|---|---|---|",
    ]
    for model, variants in c.get("models", {}).items():
        n = info.get(model, {}).get("params") or 0
        label = f"{model} ({n / 1e9:.2f} B params)" if n > 1e8 else f"{model} ({n / 1e6:.2f} M)"
        for variant, r in variants.items():
            div = "; ".join(
                f"{p['prompt']} @ {p['first_diff']} ({_f(p['tp1_top2_gap'], '.1e')}"
                + (", near-tie)" if p["near_tie"] else ")")
                for p in r.get("prompts", [])
                if not p["identical"]
            )
            graphs = {"graphs": "on", "eager": "off"}.get(variant, variant)
            out.append(
                f"| {label} | {graphs} | {r.get('identical', r.get('error', 'n/a'))} "
                f"| {div or '-'} | {_ok(r.get('passed'))} |"
            )
    out.append(f"\nnear-tie: TP=1's top-2 logprob gap below {args.tie_gap:g} where they part")
    return out


def _latency_md(args, res: dict) -> list[str]:
    r = res["latency"]
    out = [
        f"\n### Batch-1 decode: {args.model} {args.dtype}, {args.lat_input} in / "
        f"{args.lat_output} out, mean of {args.lat_iters}\n",
        "| TP | TTFT ms | decode ms/token | e2e ms |",
        "|---|---|---|---|",
    ]
    for tp in _ints(args.tps):
        x = r.get(f"tp{tp}", {})
        if "mean_tpot_ms" in x:
            out.append(
                f"| {tp} | {_f(x['mean_ttft_ms'])} | {_f(x['mean_tpot_ms'])} "
                f"| {_f(x['mean_e2el_ms'], '.1f')} |"
            )
        else:
            out.append(f"| {tp} | {_failed(x)} | | |")
    out.append(
        f"\nfloor: TP=2 decode <= {FLOOR_TP2_RATIO} x TP=1: TP=2/TP=1 = "
        f"{_f(r.get('tp2_over_tp1'))}: {_ok(r.get('passed'))}"
    )
    return out + _cmds(*(r.get(f"tp{tp}", {}).get("command") for tp in _ints(args.tps)))


def _throughput_md(args, res: dict) -> list[str]:
    r = res["throughput"]
    out = [
        f"\n### Offline throughput: {args.tp_prompts} prompts, {args.tp_input} in / "
        f"{args.tp_output} out\n",
        "| TP | elapsed s | output tok/s | total tok/s |",
        "|---|---|---|---|",
    ]
    for tp in _ints(args.tps):
        x = r.get(f"tp{tp}", {})
        if "total_tokens_per_s" in x:
            out.append(
                f"| {tp} | {_f(x['elapsed_s'], '.1f')} | {_f(x['output_tokens_per_s'], '.0f')} "
                f"| {_f(x['total_tokens_per_s'], '.0f')} |"
            )
        else:
            out.append(f"| {tp} | {_failed(x)} | | |")
    out.append(f"\nTP=2/TP=1 total tok/s: {_f(r.get('tp2_over_tp1'))}")
    return out + _cmds(*(r.get(f"tp{tp}", {}).get("command") for tp in _ints(args.tps)))


_SERVE_HEAD = [
    "| server | load | completed/failed | median TTFT ms | p99 TTFT ms | median ITL ms "
    "| median TPOT ms | output tok/s | requests per replica |",
    "|---|---|---|---|---|---|---|---|---|",
]
# (load, figure, higher is better): how DP=2 and TP=2 are compared
_COMPARE = (
    ("burst", "output_throughput", True),
    ("burst", "median_ttft_ms", False),
    ("rate", "median_ttft_ms", False),
    ("rate", "median_itl_ms", False),
)


def _serve_rows(label: str, s: dict) -> list[str]:
    rows = []
    for load in ("rate", "burst"):
        x = s.get(load, {})
        if "median_ttft_ms" not in x:
            continue
        per = "/".join(str(v) for v in x.get("requests_per_replica", {}).values())
        rows.append(
            f"| {label} | {load} | {x.get('completed')}/{x.get('failed')} "
            f"| {_f(x['median_ttft_ms'])} | {_f(x.get('p99_ttft_ms'))} "
            f"| {_f(x.get('median_itl_ms'))} | {_f(x.get('median_tpot_ms'))} "
            f"| {_f(x.get('output_throughput'), '.0f')} | {per or '-'} |"
        )
    return rows


def _loads_md(args, rate: float) -> str:
    return (
        f"rate: {args.serve_prompts} requests at {rate:g}/s, {args.serve_input} in / "
        f"{args.serve_output} out; burst: {args.burst_prompts} x {args.tp_input} in / "
        f"{args.tp_output} out, sent at once; requests per replica from GET /fleet (prompt "
        "tokens received), the client's probe request included\n"
    )


def _dp_md(args, res: dict) -> list[str]:
    tp, dp = res.get("serve", {}), res.get("dp", {})
    rows = _serve_rows("TP=2", tp) + _serve_rows("DP=2", dp)
    if not rows:
        return []
    out = [f"\n### Serving: TP=2 against DP=2, {args.model} {args.dtype}\n"]
    out += [_loads_md(args, args.serve_rate), *_SERVE_HEAD, *rows, ""]
    for load, key, higher in _COMPARE:
        a, b = tp.get(load, {}).get(key), dp.get(load, {}).get(key)
        if a and b:
            win = "DP=2" if (b > a) == higher else "TP=2"
            out.append(f"- {load} {key}: TP=2 {_f(a)}, DP=2 {_f(b)}; DP/TP {b / a:.2f}: **{win}**")
    return out + _cmds(*tp.get("commands", []), *dp.get("commands", [])[:1])


def _big_md(args, res: dict) -> list[str]:
    r = res["70b"]
    out = [
        f"\n### {args.big_model} {args.dtype}, dummy weights\n",
        f"| TP | batch-1 decode ms/token | TTFT ms | {args.big_prompts} x {args.tp_input}/"
        f"{args.tp_output}: output tok/s | total tok/s |",
        "|---|---|---|---|---|",
    ]
    cmds = []
    for tp in _ints(args.big_tps):
        x = r.get(f"tp{tp}", {})
        if x.get("skipped"):
            out.append(f"| {tp} | {x['skipped']} | | | |")
            continue
        lat, thr = x.get("latency", {}), x.get("throughput", {})
        out.append(
            f"| {tp} | {_f(lat.get('mean_tpot_ms'))} | {_f(lat.get('mean_ttft_ms'))} "
            f"| {_f(thr.get('output_tokens_per_s'), '.0f')} "
            f"| {_f(thr.get('total_tokens_per_s'), '.0f')} |"
        )
        cmds += [lat.get("command"), thr.get("command")]
    return out + _cmds(*cmds)


def _fleet_md(args, res: dict) -> list[str]:
    f = res["fleet"]
    if "fleet_file" not in f:
        return []
    out = ["\n### Fleet: one TP=2 group and two TP=1 replicas (`paged serve --fleet`)\n"]
    out += ["```yaml", f["fleet_file"].rstrip(), "```\n", _loads_md(args, args.fleet_rate)]
    out += [*_SERVE_HEAD, *_serve_rows("fleet", f)]
    if reps := f.get("fleet", {}).get("replicas"):
        out += ["", "| replica | platform | health | prompt tokens | speed tok/s |"]
        out += ["|---|---|---|---|---|"]
        out += [
            f"| {x['index']} | {x.get('platform')} | {x.get('health')} "
            f"| {_f(x.get('prompt_tokens'), '.0f')} | {_f(x.get('speed_tokens_per_s'), '.0f')} |"
            for x in reps
        ]
    return out + _cmds(*f.get("commands", [])[:1])


def save(args, out: Path, facts: dict, res: dict, started: str, final: bool) -> None:
    md = report(args, facts, res, started)
    (out / "multi_gpu.md").write_text(md)
    record = {"date": started, "argv": sys.argv, "args": vars(args), "machine": facts,
              "results": res}  # fmt: skip
    (out / "multi_gpu.json").write_text(json.dumps(record, indent=1, default=str))
    if final and not args.no_append and not args.cpu_smoke:
        try:
            with open(H.RESULTS / "h200.md", "a") as f:
                f.write(md)
        except OSError as e:
            print(f"could not write {H.RESULTS}: {e}", flush=True)


def machine_facts(ctx: Ctx) -> dict:
    """GPU facts from a child (this process never initialises CUDA)."""
    if ctx.smoke:
        import torch

        return {"gpus": 0, "torch": torch.__version__}
    path = _fresh(ctx.out / "facts.json")
    H.run("facts", [sys.executable, __file__, "--_facts", str(path)], 120, ctx.logs, echo=3)
    facts = H._load(path)
    if facts.get("topology"):
        (ctx.logs / "topology.txt").write_text(facts["topology"])
    return facts


def main(argv: list[str] | None = None) -> int:
    os.environ.update(MULTICAST_OFF)  # every child inherits it (h200._env copies os.environ)
    args = parse_args(argv)
    if args._facts or args._engine:
        (child_facts if args._facts else child_engine)(args._facts or args._engine)
        return 0
    if args._build:
        child_build(args._build, args.corr_layers, args.cpu_smoke)
        return 0
    deadline = time.monotonic() + args.budget
    phases = _names(args.phases)
    if bad := [p for p in phases if p not in RUNNERS]:
        print(f"unknown phases {bad}; choose from {', '.join(PHASES)}", file=sys.stderr)
        return 2
    ctx = Ctx(Path(args.out), args.cpu_smoke)
    ctx.logs.mkdir(parents=True, exist_ok=True)
    started = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    facts = machine_facts(ctx)
    ctx.gpus = 2 if ctx.smoke else int(facts.get("gpus") or 0)  # smoke: two CPU ranks
    ctx.gpus = ctx.gpus if args.gpus is None else args.gpus
    print(f"machine: {facts.get('gpu', 'CPU')} x {ctx.gpus}", flush=True)
    res: dict[str, dict] = {}
    for phase in phases:
        left = deadline - time.monotonic() - RESERVE_S
        if ctx.gpus < (n := needs(phase, args)):
            res[phase] = {"skipped": f"skipped: needs {n} GPUs, {ctx.gpus} present"}
        elif left < 20:
            res[phase] = {"skipped": f"skipped: only {left:.0f} s left of --budget"}
        if phase in res:
            print(f"[{phase}] {res[phase]['skipped']}", flush=True)
            continue
        t0 = time.monotonic()
        try:
            res[phase] = RUNNERS[phase](args, ctx, min(getattr(args, f"{phase}_timeout"), left))
        except Exception as e:  # one phase failing must not lose the others
            res[phase] = {"error": f"{type(e).__name__}: {e}"}
            print(f"[{phase}] failed: {res[phase]['error']}", flush=True)
        res[phase]["phase_s"] = round(time.monotonic() - t0, 1)
        save(args, ctx.out, facts, res, started, final=False)  # a later kill still leaves these
    save(args, ctx.out, facts, res, started, final=True)
    print((ctx.out / "multi_gpu.md").read_text(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
