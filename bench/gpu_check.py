"""GPU correctness: paged vs HF transformers on the same random ~1B Llama weights.

    python bench/gpu_check.py [--out DIR]

float32: greedy tokens must be identical, CUDA graphs on and off. bfloat16: logprobs of the
tokens paged chose, against HF's bfloat16 forward over the same sequence (teacher forcing).
Long prompts (--long, default 3000, 5000 and 9000 tokens: 2 to 5 prefill chunks of the
default 2048-token step budget) in float32 against HF, with and without overlapped steps,
and in bfloat16 (logprobs against the float32 truth).
Also measures the ceilings (copy bandwidth, bf16 matmul rate). Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402


def ceilings() -> dict[str, float]:
    n = 1 << 30  # 1 Gi bf16 elements = 2 GiB per buffer
    a = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    t, reps = time.perf_counter(), 10
    for _ in range(reps):
        b.copy_(a)
    torch.cuda.synchronize()
    copy_gbs = 2 * a.numel() * 2 * reps / (time.perf_counter() - t) / 1e9
    del a, b
    x = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    y = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        x @ y
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        x @ y
    torch.cuda.synchronize()
    tflops = 2 * 8192**3 * 20 / (time.perf_counter() - t) / 1e12
    return {"copy_GBps": round(copy_gbs, 1), "bf16_matmul_TFLOPs": round(tflops, 1)}


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out, ids, past = [], torch.tensor([prompt], device="cuda"), None
    with torch.inference_mode():
        for _ in range(n):
            res = model(ids, past_key_values=past, use_cache=True)
            past = res.past_key_values
            tok = int(res.logits[0, -1].argmax())
            out.append(tok)
            ids = torch.tensor([[tok]], device="cuda")
    return out


def hf_logprobs(model, prompt: list[int], gen: list[int]) -> list[float]:
    ids = torch.tensor([prompt + gen], device="cuda")
    with torch.inference_mode():
        lp = model(ids).logits[0, len(prompt) - 1 : -1].float().log_softmax(-1)
    return lp.gather(1, torch.tensor(gen, device="cuda")[:, None]).squeeze(1).tolist()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--long", default="3000,5000,9000", help="long prompt lengths ('' skips)")
    ap.add_argument("--long-only", action="store_true", help="only the long-prompt checks")
    args = ap.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    from paged import LLM, SamplingParams
    from paged.model.shapes import SHAPES

    report: dict = {"device": torch.cuda.get_device_name(0), "ceilings": ceilings()}
    print("ceilings", report["ceilings"], flush=True)
    shape = dict(
        SHAPES["llama-3.2-1b"], num_hidden_layers=args.layers, max_position_embeddings=16384
    )
    cfg = LlamaConfig(**shape)
    cfg.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = LlamaForCausalLM(cfg).float().eval()
    report["params_B"] = round(sum(p.numel() for p in hf.parameters()) / 1e9, 3)
    tmp = tempfile.mkdtemp()
    hf.save_pretrained(tmp, safe_serialization=True)
    g = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()
        for n in (5, 17, 64, 100, 129, 200, 300, 513)
    ]
    n = args.new_tokens
    if args.long_only:
        long_prompts(args, report, hf, tmp, cfg.vocab_size)
        print(json.dumps(report, indent=1), flush=True)
        return
    t = time.perf_counter()
    ref = [hf_greedy(hf, p, n) for p in prompts]
    print(f"HF fp32 reference in {time.perf_counter() - t:.1f}s", flush=True)
    greedy = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    variants = {  # name -> engine flags
        "graphs": {},
        "eager": {"enforce_eager": True},
        "graphs_no_overlap": {"async_scheduling": False},
    }
    for variant, flags in variants.items():
        llm = LLM(
            tmp,
            dtype="float32",
            max_model_len=2048,
            gpu_memory_utilization=0.5,
            max_num_seqs=64,
            **flags,
        )
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        got = [o.outputs[0].token_ids for o in outs]
        same = [a == b for a, b in zip(got, ref)]
        first_diff = [
            next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
            for a, b in zip(got, ref)
        ]
        key = f"fp32_identical_{variant}"
        report[key] = f"{sum(same)}/{len(same)}"
        report[key + "_first_diff"] = first_diff
        report[key + "_overlap"] = llm.engine.runner.overlap
        print(key, report[key], first_diff, flush=True)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    sampled_check(report, tmp, prompts[:4], n)
    import copy

    hf16 = copy.deepcopy(hf).to(torch.bfloat16)
    toks = {}
    for eager in (False, True):
        llm = LLM(
            tmp,
            dtype="bfloat16",
            max_model_len=2048,
            enforce_eager=eager,
            gpu_memory_utilization=0.5,
            max_num_seqs=64,
        )
        outs = llm.generate(
            prompts,
            SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1),
            use_tqdm=False,
        )
        toks[eager] = [o.outputs[0].token_ids for o in outs]
        if not eager:
            # Error against the float32 truth: ours in bf16 beside HF's own bf16 forward.
            d_ours, d_hf, d_pair = [], [], []
            for p, o in zip(prompts, outs):
                gen = o.outputs[0].token_ids
                ours = [e[t].logprob for e, t in zip(o.outputs[0].logprobs, gen)]
                truth = hf_logprobs(hf, p, gen)
                theirs = hf_logprobs(hf16, p, gen)
                d_ours += [abs(a - b) for a, b in zip(ours, truth)]
                d_hf += [abs(a - b) for a, b in zip(theirs, truth)]
                d_pair += [abs(a - b) for a, b in zip(ours, theirs)]
            for name, d in (
                ("paged_bf16_vs_fp32", d_ours),
                ("hf_bf16_vs_fp32", d_hf),
                ("paged_bf16_vs_hf_bf16", d_pair),
            ):
                report[f"logprob_absdiff_{name}"] = {
                    "mean": round(sum(d) / len(d), 5),
                    "max": round(max(d), 4),
                }
            report["bf16_greedy_match_hf_bf16"] = sum(
                a == b for a, b in zip(toks[eager], [hf_greedy(hf16, p, n) for p in prompts])
            )
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    report["bf16_graphs_vs_eager_identical"] = toks[False] == toks[True]
    if args.long:
        long_prompts(args, report, hf, tmp, cfg.vocab_size)
    print(json.dumps(report, indent=1), flush=True)
    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
        json.dump(report, f, indent=1)


def sampled_check(report: dict, path: str, prompts: list[list[int]], n: int) -> None:
    """Sampled decodes in float32: the sampler graphs against the eager sampler from the same
    seed (the same random numbers in the same order: identical tokens expected). Four
    requests with top-p, min-p, top-k and greedy (the sorting graph), then one with a
    temperature alone (the plain graph)."""
    from paged import LLM, SamplingParams

    common = dict(max_tokens=n, ignore_eos=True)
    mix = [SamplingParams(temperature=0.8, top_p=0.9, **common),
           SamplingParams(temperature=1.0, min_p=0.05, **common),
           SamplingParams(temperature=0.7, top_k=40, **common),
           SamplingParams(temperature=0, **common)]  # fmt: skip
    plain = SamplingParams(temperature=0.9, **common)
    toks: dict[bool, list] = {}
    for eager in (False, True):
        llm = LLM(path, dtype="float32", max_model_len=2048, gpu_memory_utilization=0.5,
                  max_num_seqs=64, enforce_eager=eager, seed=7)  # fmt: skip
        if not eager:
            report["sampler_graphs"] = len(llm.engine.runner.step_runner.sample_graphs)
        torch.manual_seed(7)
        outs = llm.generate(prompts[: len(mix)], mix, use_tqdm=False)
        outs += llm.generate(prompts[:1], plain, use_tqdm=False)
        toks[eager] = [o.outputs[0].token_ids for o in outs]
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    same = sum(a == b for a, b in zip(toks[False], toks[True]))
    report["sampled_graphs_vs_eager_identical"] = f"{same}/{len(toks[True])}"
    print("sampled: graphs vs eager", report["sampled_graphs_vs_eager_identical"],
          "sampler graphs", report.get("sampler_graphs"), flush=True)  # fmt: skip


def long_prompts(args, report: dict, hf, path: str, vocab: int) -> None:
    """Prompts of several prefill chunks: float32 greedy against HF, and bf16 logprobs."""
    from paged import LLM, SamplingParams

    g = torch.Generator().manual_seed(2)
    lens = [int(x) for x in args.long.split(",")]
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]
    n = 16
    t = time.perf_counter()
    ref = [hf_greedy(hf, p, n) for p in prompts]
    print(f"HF fp32 long-prompt reference in {time.perf_counter() - t:.1f}s", flush=True)
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1)
    for name, dtype, flags in (
        ("fp32", "float32", {}),
        ("fp32_no_overlap", "float32", {"async_scheduling": False}),
        ("bf16", "bfloat16", {}),
    ):
        llm = LLM(path, dtype=dtype, max_model_len=16384, gpu_memory_utilization=0.5,
                  max_num_seqs=16, **flags)  # fmt: skip
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        took = time.perf_counter() - t
        got = [o.outputs[0].token_ids for o in outs]
        key = f"long_{name}"
        report[key + "_seconds"] = round(took, 2)
        if dtype == "float32":
            same = [a == b for a, b in zip(got, ref)]
            report[key + "_identical"] = f"{sum(same)}/{len(same)}"
        else:
            diffs = []
            for p, o in zip(prompts, outs):
                gen = o.outputs[0].token_ids
                ours = [e[tok].logprob for e, tok in zip(o.outputs[0].logprobs, gen)]
                diffs += [abs(a - b) for a, b in zip(ours, hf_logprobs(hf, p, gen))]
            report[key + "_logprob_absdiff_vs_fp32"] = {
                "mean": round(sum(diffs) / len(diffs), 5),
                "max": round(max(diffs), 4),
            }
        print(key, {k: v for k, v in report.items() if k.startswith(key)}, flush=True)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    report["long_prompt_lengths"] = lens


if __name__ == "__main__":
    main()
