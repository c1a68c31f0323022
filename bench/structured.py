"""Structured outputs on CPU: throughput with every request JSON-schema constrained against the
same run unconstrained, and the time to first token of a request with a new schema.

    python bench/structured.py [--num-prompts 64] [--max-tokens 64] [--repeat 2]

Default model, greedy, batch --num-prompts. The schema (an array of records, unbounded) keeps
every constrained request generating until --max-tokens, so both runs do the same steps at the
same batch size; end-of-sequence is ignored in the unconstrained run. Runs alternate (plain,
constrained, plain, ...) in one engine so that host noise hits both; the per-step cost of the
mask path (filling the bitmask in the core, applying it in the sampler) is timed separately.
Results go to bench/results/structured.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from common import chat_prompts, write_results  # noqa: E402

from paged import LLM, SamplingParams  # noqa: E402
from paged.model import ops  # noqa: E402
from paged.model.loader import default_model_path  # noqa: E402
from paged.sampling.params import StructuredOutputsParams  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "people": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "city": {"type": "string"},
                    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}},
                },
                "required": ["name", "age", "city", "tags"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["people"],
    "additionalProperties": False,
}


class Timer:
    """Wall time spent in a function (patched in place)."""

    def __init__(self, owner, name: str) -> None:
        self.total, self.calls = 0.0, 0
        fn = getattr(owner, name)

        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.total += time.perf_counter() - t
                self.calls += 1

        setattr(owner, name, timed)

    def reset(self) -> None:
        self.total, self.calls = 0.0, 0

    def ms(self) -> float:
        return 1e3 * self.total / max(self.calls, 1)


def run(llm: LLM, convs, params) -> tuple[float, int, float]:
    """(tokens/s, tokens, seconds) of one batch."""
    t = time.perf_counter()
    outs = llm.chat(convs, params, use_tqdm=False)
    dt = time.perf_counter() - t
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return n / dt, n, dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--ttft-runs", type=int, default=5)
    args = ap.parse_args()
    llm = LLM(default_model_path(), dtype=args.dtype, max_model_len=2048)
    convs = [
        [{"role": "user", "content": c[0]["content"] + " Answer in JSON."}]
        for c in chat_prompts(args.num_prompts)
    ]
    plain = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    so = StructuredOutputsParams(json=SCHEMA)
    constrained = SamplingParams(temperature=0, max_tokens=args.max_tokens, structured_outputs=so)
    llm.chat(convs[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    llm.chat(convs[:2], SamplingParams(max_tokens=4, structured_outputs=so), use_tqdm=False)
    fill = Timer(llm.engine.structured, "bitmask")
    apply_fn = ops._active["apply_token_bitmask"]
    applied = {"total": 0.0, "calls": 0}

    def timed_apply(*a):
        t = time.perf_counter()
        apply_fn(*a)
        applied["total"] += time.perf_counter() - t
        applied["calls"] += 1

    ops._active["apply_token_bitmask"] = timed_apply
    steps = Timer(llm.engine, "step")
    accept = Timer(llm.engine.structured, "accept")
    res: dict[str, list] = {"plain": [], "json_schema": []}
    nsteps: dict[str, list] = {"plain": [], "json_schema": []}
    fill_ms, apply_ms, accept_ms, step_ms = [], [], [], []
    for i in range(args.repeat):  # ABBA order: a load that drifts hits both alike
        for kind in ("plain", "json_schema") if i % 2 == 0 else ("json_schema", "plain"):
            fill.reset(), steps.reset(), accept.reset()
            applied.update(total=0.0, calls=0)
            res[kind].append(run(llm, convs, plain if kind == "plain" else constrained))
            nsteps[kind].append(steps.calls)
            if kind == "json_schema":
                fill_ms.append(fill.ms())
                apply_ms.append(1e3 * applied["total"] / max(applied["calls"], 1))
                accept_ms.append(1e3 * accept.total / max(steps.calls, 1))
                step_ms.append(steps.ms())

    # TTFT: one request alone, max_tokens=1 (prefill + first token). Kinds interleave, and
    # every request has a prompt of its own (no prefix-cache hit beyond the chat template's).
    def ttft(i: int, params) -> float:
        conv = [{"role": "user", "content": f"Request {i}: {convs[i % len(convs)][0]['content']}"}]
        t = time.perf_counter()
        llm.chat([conv], params, use_tqdm=False)
        return 1e3 * (time.perf_counter() - t)

    base, fresh, cached, compile_ms = [], [], [], []
    for i in range(args.ttft_runs):
        schema = json.loads(json.dumps(SCHEMA))
        schema["properties"][f"compiled_alone_{i}_{time.time_ns()}"] = {"type": "integer"}
        t = time.perf_counter()  # the compile alone, as the core's pool runs it
        llm.engine.structured._compile(StructuredOutputsParams(json=schema))
        compile_ms.append(1e3 * (time.perf_counter() - t))
    for i in range(args.ttft_runs):
        schema = json.loads(json.dumps(SCHEMA))
        schema["properties"][f"new_field_{i}_{time.time_ns()}"] = {"type": "integer"}
        new = StructuredOutputsParams(json=schema)  # never compiled before
        base.append(ttft(3 * i, SamplingParams(temperature=0, max_tokens=1)))
        fresh.append(ttft(3 * i + 1, SamplingParams(temperature=0, max_tokens=1,
                                                    structured_outputs=new)))  # fmt: skip
        cached.append(ttft(3 * i + 2, SamplingParams(temperature=0, max_tokens=1,
                                                     structured_outputs=so)))  # fmt: skip
    n, m = args.num_prompts, args.max_tokens
    rows = []
    if args.repeat:
        tps = {k: statistics.median(r[0] for r in v) for k, v in res.items()}
        ratios = [c[0] / p[0] for p, c in zip(res["plain"], res["json_schema"])]
        slower = 100 * (1 - statistics.median(ratios))
        mask_ms = statistics.median(f + a + c for f, a, c in zip(fill_ms, apply_ms, accept_ms))
        rows += [
            (
                f"pass {i + 1}: {k}, {n} x {m}",
                f"{r[0]:.1f} tok/s ({r[1]} tokens, {nsteps[k][i]} steps, {r[2]:.1f} s)",
            )
            for i in range(args.repeat)
            for k, r in ((k, res[k][i]) for k in res)
        ]
        rows += [
            ("median plain / json_schema", f"{tps['plain']:.1f} / {tps['json_schema']:.1f} tok/s"),
            ("json_schema slower by (median of paired passes)", f"{slower:.1f} % (floor: 10 %)"),
            ("mask fill per step (core, 64 matchers)", f"{statistics.median(fill_ms):.2f} ms"),
            ("mask apply per step (sampler)", f"{statistics.median(apply_ms):.2f} ms"),
            ("matchers' accept per step (core)", f"{statistics.median(accept_ms):.2f} ms"),
            ("engine step, constrained run", f"{statistics.median(step_ms):.1f} ms"),
            ("mask path share of a constrained step",
             f"{100 * mask_ms / statistics.median(step_ms):.1f} %"),
        ]  # fmt: skip
    rows += [
        (f"compile of a new schema (median of {args.ttft_runs})",
         f"{statistics.median(compile_ms):.0f} ms"),
        (f"TTFT unconstrained (median of {args.ttft_runs})", f"{statistics.median(base):.0f} ms"),
        (f"TTFT new schema, compile included (median of {args.ttft_runs})",
         f"{statistics.median(fresh):.0f} ms"),
        (f"TTFT schema compiled before (median of {args.ttft_runs})",
         f"{statistics.median(cached):.0f} ms"),
    ]  # fmt: skip
    for k, v in rows:
        print(f"{k}: {v}")
    write_results(
        "structured.md",
        f"Structured outputs, default model, {n} chat prompts x {m} tokens, greedy, "
        f"dtype {args.dtype}",
        rows,
        {
            "tok_s": res,
            "fill_ms": fill_ms,
            "apply_ms": apply_ms,
            "step_ms": step_ms,
            "ttft_ms": {"plain": base, "new_schema": fresh, "cached_schema": cached},
            "compile_ms": compile_ms,
        },  # fmt: skip
    )


if __name__ == "__main__":
    main()
