"""``paged bench throughput`` and ``paged bench latency``: offline, through ``LLM``.

Random token-id prompts of ``--input-len``, ``--output-len`` tokens each with ignore_eos.
``--model`` is a directory or .gguf, or with ``--load-format dummy`` a named shape
(paged.model.shapes). Other implementations plug in through ``BASELINES``.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

from paged.cli.bench_common import flag_error, print_metrics, save_json, save_json_error, stats

if TYPE_CHECKING:
    from paged.config import EngineConfig
    from paged.engine.llm import LLM

# name -> fn(args, prompts, output_len, llm, metrics) -> seconds to generate output_len tokens
# for every prompt (ignore_eos), or a dict of figures merged into the results (the baseline
# printed its own comparison; it may release llm's engine). Registered by whoever adds a
# baseline (e.g. "hf", in bench_hf).
Baseline = Callable[..., float | dict]
BASELINES: dict[str, Baseline] = {}


def register_baseline(name: str) -> Callable[[Baseline], Baseline]:
    def deco(fn: Baseline) -> Baseline:
        BASELINES[name] = fn
        return fn

    return deco


def register(sub: argparse._SubParsersAction, load: bool = True) -> None:
    for name, help in (
        ("throughput", "offline generation throughput (tokens/s) through LLM"),
        ("latency", "offline latency of one batch: TTFT and per-token decode time"),
    ):
        p = sub.add_parser(name, help=help)
        if load:  # the engine flags import torch: only when this command runs
            from paged.config import EngineConfig
            from paged.logs import LOG_LEVELS

            EngineConfig.add_cli_args(p, positional_model=False)
            p.add_argument(
                "--log-level",
                default="warning",
                choices=LOG_LEVELS,
                help="the engine's log (info: its start-up phases and their times)",
            )
        p.add_argument("--input-len", type=int, default=128, help="prompt tokens")
        p.add_argument("--output-len", type=int, default=128, help="output tokens")
        if name == "throughput":
            p.add_argument("--num-prompts", type=int, default=64, help="prompts")
        else:
            p.add_argument("--batch-size", type=int, default=8, help="prompts in the batch")
            p.add_argument("--num-iters-warmup", type=int, default=1, help="untimed runs")
            p.add_argument("--num-iters", type=int, default=3, help="timed runs")
        p.add_argument(
            "--baseline", default=None, help="also run the same prompts through this implementation"
        )
        p.add_argument("--save-json", default=None, help="write all figures and the command")
        p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
        from paged.cli import bench_hf  # registers --baseline hf (imports nothing heavy)

        bench_hf.add_args(p, name)
        p.set_defaults(func=run_throughput if name == "throughput" else run_latency)


# the least value of each count and length flag (the --hf-* ones of --baseline hf too)
LEAST = dict(input_len=1, output_len=1, num_prompts=1, batch_size=1, num_iters=1,
             num_iters_warmup=0, hf_batch_size=1, hf_num_iters=1, hf_num_prompts=1)  # fmt: skip


def checked_config(args: argparse.Namespace) -> EngineConfig | None:
    """The EngineConfig, or None once a flag was refused with one line (before any load)."""
    from paged.config import EngineConfig

    def refuse(problem: str) -> None:
        print(f"error: {problem}", file=sys.stderr)

    from paged.logs import configure_logging

    configure_logging(args.log_level, paged_too=True)
    if problem := flag_error(args, LEAST, {"hf_max_seconds": 0}) or save_json_error(args.save_json):
        return refuse(problem)
    if args.baseline and args.baseline not in BASELINES:
        known = ", ".join(BASELINES) or "none registered"
        return refuse(f"--baseline: no baseline named {args.baseline!r} ({known})")
    try:
        config = EngineConfig.from_cli_args(args)
    except ValueError as e:
        return refuse(f"invalid configuration: {e}")
    need = args.input_len + args.output_len
    if config.max_model_len is None:  # only what the benchmark needs: a smaller KV cache
        config.max_model_len = need
    elif config.max_model_len < need:
        return refuse(f"--max-model-len {config.max_model_len} is below --input-len + "
                      f"--output-len ({need})")  # fmt: skip
    return config


def build_llm(config: EngineConfig) -> LLM:
    from paged.engine.llm import LLM

    kwargs = {k: v for k, v in vars(config).items() if k != "model"}
    return LLM(config.model, **kwargs)


def random_prompts(n: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(n)]


def _params(output_len: int):
    from paged.sampling.params import SamplingParams

    return SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=output_len)


def _baseline(
    args: argparse.Namespace, prompts: list[list[int]], llm, m: dict
) -> float | dict | None:
    if not args.baseline:
        return None
    return BASELINES[args.baseline](args, prompts, args.output_len, llm, m)  # checked_config


def _setup(args: argparse.Namespace) -> str:
    model = args.model or "the default model"
    return f"{model} ({args.load_format}), input {args.input_len}, output {args.output_len}"


def run_throughput(args: argparse.Namespace) -> int:
    if (config := checked_config(args)) is None:
        return 2
    llm = build_llm(config)
    prompts = random_prompts(args.num_prompts, args.input_len, llm.engine.vocab_size, args.seed)
    llm.generate([{"prompt_token_ids": prompts[0]}], _params(2), use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        _params(args.output_len),
        use_tqdm=not args.disable_tqdm,
    )
    elapsed = time.perf_counter() - t0
    n_in = sum(len(p) for p in prompts)
    n_out = sum(len(c.token_ids) for o in outs for c in o.outputs)
    m = {
        "setup": _setup(args),
        "num_requests": len(prompts),
        "elapsed_s": elapsed,
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "requests_per_s": len(prompts) / elapsed,
        "total_tokens_per_s": (n_in + n_out) / elapsed,
        "output_tokens_per_s": n_out / elapsed,
    }
    rows = [
        ("Requests", "num_requests"),
        ("Elapsed (s)", "elapsed_s"),
        ("Request throughput (req/s)", "requests_per_s"),
        ("Output token throughput (tok/s)", "output_tokens_per_s"),
        ("Total token throughput (tok/s)", "total_tokens_per_s"),
    ]
    base = _baseline(args, prompts, llm, m)
    if isinstance(base, dict):
        m |= base
    elif base is not None:
        m |= {
            "baseline": args.baseline,
            "baseline_elapsed_s": base,
            "baseline_output_tokens_per_s": len(prompts) * args.output_len / base,
            "speedup": base / elapsed,
        }
        rows += [
            (f"{args.baseline} output throughput (tok/s)", "baseline_output_tokens_per_s"),
            ("Speedup", "speedup"),
        ]
    print(f"setup: {m['setup']}")
    print_metrics("Offline Throughput", m, rows)
    if args.save_json:
        save_json(args.save_json, args, m)
    return 0


def timed_batch(engine, prompts: list[list[int]], params) -> tuple[float, list[float], float]:
    """(TTFT of the batch, decode step times, end-to-end), stepping the engine directly."""
    tag = uuid.uuid4().hex[:8]
    ids = [f"latency-{tag}-{i}" for i in range(len(prompts))]
    t0 = last = time.perf_counter()
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, params)
    first: dict[str, float] = {}
    decode: list[float] = []
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        if len(first) == len(ids):  # every sequence past prefill: a pure decode step
            decode.append(now - last)
        for o in outs:
            if o.error:
                raise RuntimeError(f"request {o.request_id} failed: {o.error}")
            if o.new_token_ids and o.request_id not in first:
                first[o.request_id] = now - t0
        last = now
    return max(first.values()), decode, last - t0


def run_latency(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    if (config := checked_config(args)) is None:
        return 2
    llm = build_llm(config)
    prompts = random_prompts(args.batch_size, args.input_len, llm.engine.vocab_size, args.seed)
    params = _params(args.output_len)
    for _ in tqdm(range(args.num_iters_warmup), desc="warm-up", disable=args.disable_tqdm):
        timed_batch(llm.engine, prompts, params)
    ttfts, decode, e2e = [], [], []
    for _ in tqdm(range(args.num_iters), desc="iterations", disable=args.disable_tqdm):
        t, d, e = timed_batch(llm.engine, prompts, params)
        ttfts.append(t)
        decode += d
        e2e.append(e)
    m = {"setup": _setup(args), "batch_size": args.batch_size, "num_iters": args.num_iters}
    m |= stats("ttft", ttfts) | stats("tpot", decode) | stats("e2el", e2e)
    m["decode_tokens_per_s"] = args.batch_size * 1000 / m["mean_tpot_ms"] if decode else 0.0
    rows = [
        ("Batch size", "batch_size"),
        ("Iterations", "num_iters"),
        ("Decode throughput (tok/s)", "decode_tokens_per_s"),
    ]
    base = _baseline(args, prompts, llm, m)
    if isinstance(base, dict):
        m |= base
    elif base is not None:
        m |= {
            "baseline": args.baseline,
            "baseline_e2el_ms": base * 1000,
            "speedup": base * 1000 / m["mean_e2el_ms"],
        }
        rows += [(f"{args.baseline} end-to-end (ms)", "baseline_e2el_ms"), ("Speedup", "speedup")]
    print(f"setup: {m['setup']}")
    print_metrics(
        "Offline Latency",
        m,
        rows,
        sections=[
            ("Time to First Token", "ttft"),
            ("Decode Latency per Token", "tpot"),
            ("End-to-end Latency", "e2el"),
        ],
    )
    if args.save_json:
        save_json(args.save_json, args, m)
    return 0 if decode or args.output_len == 1 else 1
