"""Speculative decoding: plain decoding vs n-gram proposals vs a draft model or an EAGLE head,
same run, on a "repeat and edit this text" workload (greedy, so the outputs must be identical).

    python bench/spec_decode.py [--model PATH] [--dtype auto] [--draft PATH] [--eagle PATH] [--k 4]
        [--batch 1] [--output-len 128] [--repeat 2] [--load-format auto|dummy]

`--model`: the default model (SmolLM2-135M-Instruct GGUF) unless given; a named shape with
--load-format dummy (random weights: n-gram acceptance then says little). `--draft`: a draft
model with the target's tokenizer (left out: no draft row; the target itself is a valid draft
for checking, though never faster). `--eagle`: an EAGLE-1 head trained for the target (left
out: no eagle row). Each row: output tokens/s (best of --repeat passes, after a warm-up), the
proposals' acceptance rate, tokens per verification (1 + accepted / drafts), and whether the
greedy outputs equal plain decoding's. The floor (issue 15): n-gram at batch 1 on the default
model in bf16 >= 1.8x plain. Appends to bench/results/spec_decode.md.

On a GPU: `python bench/spec_decode.py --dtype bfloat16` (the floor's run); the draft path's
cost in real shapes: `--model llama-3.1-8b --load-format dummy --draft llama-3.2-1b` (random
weights: acceptance means nothing there, the time per verification does). On the CPU, a
shared machine: OMP_NUM_THREADS=1 (bench/results/spec_decode.md says why).
"""

from __future__ import annotations

import argparse
import gc
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from common import write_results  # noqa: E402  (bench/ is the script's directory)

from paged import LLM, SamplingParams  # noqa: E402

TEXTS = [
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He wound the "
    "clockwork, trimmed the wick and polished the great lens until it shone. Ships passing "
    "the rocks at night saw the beam sweep across the water and knew they were safe.",
    "To bake bread, mix flour, water, salt and yeast into a soft dough. Knead it for ten "
    "minutes, let it rise for an hour, shape it into a loaf and let it rise again. Bake it "
    "in a hot oven for forty minutes until the crust is brown and it sounds hollow.",
    "Honey bees live in colonies of thousands of workers, a few hundred drones and one "
    "queen. The workers collect nectar and pollen, build the wax comb, feed the larvae and "
    "guard the hive. In winter they cluster together to keep the queen warm.",
]
EDITS = [("evening", "morning"), ("ten", "twelve"), ("thousands", "tens of thousands")]


def prompts(llm: LLM, n: int) -> list:
    """n "repeat and edit" requests (chat-formatted where the model has a chat template)."""
    tok = llm.get_tokenizer()
    out = []
    for i in range(n):
        text, (a, b) = TEXTS[i % len(TEXTS)], EDITS[i % len(EDITS)]
        ask = f"Repeat the following text exactly, but replace '{a}' with '{b}'.\n\n{text}"
        if tok is None:  # token ids only: a repeated random passage
            g = torch.Generator().manual_seed(i)
            vocab = llm.engine.vocab_size
            ids = torch.randint(2, min(vocab, 1000), (60,), generator=g).tolist()
            out.append({"prompt_token_ids": ids * 3})
        elif getattr(tok, "chat_template", None):
            msgs = [{"role": "user", "content": ask}]
            out.append(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))
        else:
            out.append(ask + "\n\n")
    return out


def run(args, spec: dict | None) -> dict:
    kw = dict(dtype=args.dtype, load_format=args.load_format, max_model_len=args.max_model_len)
    if args.kv_cache_memory:
        kw["kv_cache_memory"] = args.kv_cache_memory
    llm = LLM(args.model, speculative_config=spec, **kw)
    ps = prompts(llm, args.batch)
    params = SamplingParams(temperature=0, max_tokens=args.output_len)
    llm.generate(ps, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up
    best, outs = None, None
    for _ in range(args.repeat):
        before = llm.engine.metrics()
        t0 = time.perf_counter()
        res = llm.generate(ps, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        toks = sum(len(o.outputs[0].token_ids) for o in res)
        after = llm.engine.metrics()
        if best is None or toks / dt > best["tok_s"]:
            d = {k: after.get(k, 0) - before.get(k, 0) for k in after if "spec_decode" in k}
            best = {"tok_s": toks / dt, "tokens": toks, "seconds": dt, **d}
        outs = [o.outputs[0].token_ids for o in res]
    best["outputs"] = outs
    del llm
    gc.collect()
    if torch.cuda.is_available():  # a bench script, not the core: free the device for the next
        torch.cuda.empty_cache()
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--draft", default=None, help="a draft model (same tokenizer)")
    ap.add_argument("--eagle", default=None, help="an EAGLE-1 head for the target")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--kv-cache-memory", default=None)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args()
    if args.model is None:
        from paged.model.loader import default_model_path

        args.model = default_model_path()
    runs = {"plain": None,
            "ngram": {"method": "ngram", "num_speculative_tokens": args.k,
                      "prompt_lookup_max": 4, "prompt_lookup_min": 1}}  # fmt: skip
    if args.draft:
        runs["draft"] = {"model": args.draft, "num_speculative_tokens": args.k}
    if args.eagle:
        runs["eagle"] = {"method": "eagle", "model": args.eagle, "num_speculative_tokens": args.k}
    results = {name: run(args, spec) for name, spec in runs.items()}
    base = results["plain"]
    rows = []
    print("| run | output tok/s | vs plain | acceptance | tokens / verification | identical |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        drafts = r.get("spec_decode_num_drafts", 0)
        acc = r.get("spec_decode_num_accepted_tokens", 0)
        prop = r.get("spec_decode_num_draft_tokens", 0)
        rate = f"{acc / prop:.2f}" if prop else "-"
        per = f"{1 + acc / drafts:.2f}" if drafts else "-"
        same = r["outputs"] == base["outputs"]
        line = (f"{r['tok_s']:.1f}", f"{r['tok_s'] / base['tok_s']:.2f}x", rate, per, str(same))
        print(f"| {name} | " + " | ".join(line) + " |")
        rows.append((name, f"{line[0]} tok/s ({line[1]}), acceptance {rate}, "
                           f"{per} tokens/verification, identical {same}"))  # fmt: skip
    if not args.no_write:
        title = f"speculative decoding, batch {args.batch}, k={args.k}, {args.dtype}"
        extra = {n: {k: v for k, v in r.items() if k != "outputs"} for n, r in results.items()}
        write_results("spec_decode.md", title, rows, extra)


if __name__ == "__main__":
    main()
