"""CPU throughput: paged vs HF transformers and llama.cpp, same weights, same run.

    bash bench/install_llama_cpp.sh   # once: llama-cpp-python from source, wheel cached
    python bench/throughput.py [--num-prompts 64] [--max-tokens 128] [--repeat 2]
    python bench/throughput.py --model 8b-q4_0.gguf --gguf-only --num-prompts 8 --max-tokens 32
        # a large GGUF (bench/synthetic_gguf.py writes one in the Llama-3.1-8B shape)

Greedy, every request generates exactly --max-tokens tokens (end-of-sequence ignored) so all
engines do the same work. Two comparisons, each on the same arithmetic:
  - paged's dense bfloat16 path (--no-cpu-gguf-blocks) against HF transformers in bfloat16;
  - paged's GGUF block path (the file's quantized weights, activations quantized to 8 bits:
    labelled quantized) against llama.cpp on the same GGUF, at batch --num-prompts and 1.
Results go to bench/results/cpu.md.
"""

from __future__ import annotations

import argparse
import copy
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from common import chat_prompts, write_results  # noqa: E402
from llama_cpp_baseline import llama_cpp_throughput  # noqa: E402

from paged import LLM, SamplingParams  # noqa: E402
from paged.model.loader import default_model_path  # noqa: E402


def bench_paged(
    path: str, prompts: list[list[int]], max_tokens: int, dtype: str, **options: object
) -> float:
    """`options`: platform options, e.g. cpu_gguf_blocks=False."""
    llm = LLM(path, dtype=dtype, max_model_len=2048, **options)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
    return len(prompts) * max_tokens / dt


def hf_model(path: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    d, f = os.path.split(path)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=dtype).eval()
    gc = copy.deepcopy(model.generation_config)
    gc.eos_token_id, gc.pad_token_id, gc.do_sample = None, 0, False
    gc.temperature = gc.top_p = gc.top_k = None
    return model, gc


def bench_hf_generate(model, gc, prompts: list[list[int]], max_tokens: int, batch: int) -> float:
    gc = copy.deepcopy(gc)
    gc.max_new_tokens = gc.min_new_tokens = max_tokens
    t = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            chunk = prompts[i : i + batch]
            width = max(map(len, chunk))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk])  # left padding
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            model.generate(ids, attention_mask=mask, generation_config=gc)
    return len(prompts) * max_tokens / (time.perf_counter() - t)


def bench_hf_generate_batch(model, gc, prompts: list[list[int]], max_tokens: int) -> float:
    gc = copy.deepcopy(gc)
    gc.max_new_tokens = max_tokens
    t = time.perf_counter()
    with torch.inference_mode():
        out = model.generate_batch(inputs=prompts, generation_config=gc, progress_bar=False)
    n = sum(len(r.generated_tokens) for r in out.values())
    return n / (time.perf_counter() - t)


DEFAULT = "SmolLM2-135M-Instruct Q4_1 GGUF"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--hf-batch", default="32,64", help="HF padded batch sizes to try")
    ap.add_argument("--batch1-prompts", type=int, default=2, help="prompts for batch-1 runs")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--model", help="a GGUF file (default: the default model's); one without "
                    "a chat template gets the chats' last messages as plain prompts")  # fmt: skip
    ap.add_argument("--gguf-only", action="store_true",
                    help="only the GGUF block path and llama.cpp (no dense or HF runs: for a "
                    "model whose dense weights do not fit in memory)")  # fmt: skip
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="passes over the bfloat16 runs, paged and HF interleaved; each figure is the "
        "best of its passes (a shared host's speed drifts during a run)",
    )
    args = ap.parse_args()
    path = args.model or default_model_path()
    from paged.model.loader import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(path))
    prompts = [
        tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False)
        if tok.chat_template
        else c[-1]["content"]
        for c in chat_prompts(args.num_prompts)
    ]
    ids = [tok(p, add_special_tokens=False).input_ids for p in prompts]
    n, m = args.num_prompts, args.max_tokens
    rows, figs = [], {}

    def record(name: str, value: float | None) -> None:
        if value is None:
            return
        print(f"{name}: {value:.1f} tok/s", flush=True)
        if value < figs.get(name, 0.0):
            return
        figs[name] = round(value, 1)
        row = (name, f"{value:.1f} tok/s")
        at = next((i for i, r in enumerate(rows) if r[0] == name), None)
        rows.append(row) if at is None else rows.__setitem__(at, row)

    quant = "paged GGUF blocks (quantized: 8-bit activations)"
    dense = "paged bfloat16 dense (--no-cpu-gguf-blocks)"
    b1 = args.batch1_prompts
    for rep in range(args.repeat):
        first = rep == 0
        record(f"{quant}, {n} prompts x {m} tokens", bench_paged(path, ids, m, "bfloat16"))
        record(f"llama.cpp (same GGUF), {n} prompts x {m} tokens, batch {n}",
               llama_cpp_throughput(path, ids, m, batch=n))  # fmt: skip
        record(f"{quant}, batch 1 ({b1} prompts)", _batch1(path, ids[:b1], m))
        record(f"llama.cpp (same GGUF), batch 1 ({b1} prompts)",
               llama_cpp_throughput(path, ids[:b1], m, batch=1))  # fmt: skip
        if args.gguf_only:
            continue
        record(f"{dense}, {n} prompts x {m} tokens",
               bench_paged(path, ids, m, "bfloat16", cpu_gguf_blocks=False))  # fmt: skip
        if first:
            record(f"paged float32 dense, {n} prompts x {m} tokens",
                   bench_paged(path, ids, m, "float32", cpu_gguf_blocks=False))  # fmt: skip
        if args.skip_hf:
            continue
        for dtype in (torch.float32, torch.bfloat16) if first else (torch.bfloat16,):
            model, gc = hf_model(path, dtype)
            name = str(dtype).removeprefix("torch.")
            for hb in (int(b) for b in args.hf_batch.split(",")):
                record(
                    f"HF generate {name}, padded batch {hb}",
                    bench_hf_generate(model, gc, ids, m, hb),
                )
            record(
                f"HF generate {name}, batch 1 ({b1} prompts)",
                bench_hf_generate(model, gc, ids[:b1], m, 1),
            )
            if first and hasattr(model, "generate_batch"):
                record(
                    f"HF generate_batch {name} ({n // 4} prompts)",
                    bench_hf_generate_batch(model, gc, ids[: n // 4], m),
                )
            del model

    def ratio(label: str, ours: str, theirs: list[str]) -> None:
        base = max((figs[k] for k in theirs if k in figs), default=None)
        if ours in figs and base:
            rows.append((label, f"{figs[ours] / base:.2f}x"))
            print(f"{label}: {figs[ours] / base:.2f}x")

    hf_bf16 = [k for k in figs if k.startswith("HF generate bfloat16") and "batch 1" not in k]
    hf_bf16 += [k for k in figs if k.startswith("HF generate_batch bfloat16")]
    ratio("paged dense bf16 / best HF bf16 (same arithmetic)",
          f"{dense}, {n} prompts x {m} tokens", hf_bf16)  # fmt: skip
    ratio(f"paged GGUF blocks / llama.cpp, batch {n}", f"{quant}, {n} prompts x {m} tokens",
          [f"llama.cpp (same GGUF), {n} prompts x {m} tokens, batch {n}"])  # fmt: skip
    ratio("paged GGUF blocks / llama.cpp, batch 1", f"{quant}, batch 1 ({b1} prompts)",
          [f"llama.cpp (same GGUF), batch 1 ({b1} prompts)"])  # fmt: skip
    write_results(
        "cpu.md",
        f"Offline throughput, {Path(path).name if args.model else DEFAULT}, {n} chat "
        f"prompts x {m} new tokens, greedy"
        + (f", best of {args.repeat} passes" if args.repeat > 1 else ""),
        rows,
        {"figures": figs},
    )


def _batch1(path: str, prompts: list[list[int]], max_tokens: int) -> float:
    """One request at a time: the decode rate a single user sees."""
    llm = LLM(path, dtype="bfloat16", max_model_len=2048)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)
    t = time.perf_counter()
    for p in prompts:
        llm.generate([p], params, use_tqdm=False)
    return len(prompts) * max_tokens / (time.perf_counter() - t)


if __name__ == "__main__":
    main()
