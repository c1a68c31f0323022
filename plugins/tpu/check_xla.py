"""End-to-end check of paged-tpu on XLA:CPU (ci/xla.sh runs it with PJRT_DEVICE=CPU).

On a tiny random Llama (float32), 50 greedy requests of varied prompt and output lengths
(some sharing prefixes, long ones chunked) must give:
- tokens identical to the cpu plugin's;
- device-side greedy ids (the compiled sampling tail) identical to the tokens the host sampled;
- no XLA compilation after start-up, and no more programs than buckets in all.
Exit status 0 when all hold; a summary line either way.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

ENGINE = dict(
    dtype="float32",
    max_model_len=256,
    max_num_seqs=16,
    max_num_batched_tokens=128,
    kv_cache_memory="512KiB",  # 64 blocks: requests get preempted and recomputed
)


def make_tiny_llama(path: str, seed: int = 0) -> str:
    """The recipe of tests/conftest.py's make_tiny("llama") (no pytest in this venv)."""
    import transformers as tf

    cfg = tf.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=320,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        eos_token_id=1,
        bos_token_id=0,
    )
    torch.manual_seed(seed)
    model = tf.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return path


def workload(n: int, seed: int = 1) -> tuple[list[list[int]], list[int]]:
    """Prompts of 1..200 tokens (every fifth extends a shared 40-token prefix), outputs of
    1..24 tokens."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(2, 320, (40,), generator=g).tolist()
    prompts, lens = [], []
    for i in range(n):
        size = int(torch.randint(1, 201, (1,), generator=g))
        ids = torch.randint(2, 320, (size,), generator=g).tolist()
        prompts.append(shared + ids[:20] if i % 5 == 0 else ids)
        lens.append(int(torch.randint(1, 25, (1,), generator=g)))
    return prompts, lens


def generate(llm, prompts: list[list[int]], lens: list[int]) -> list[list[int]]:
    from paged import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def watch_device_greedy(llm) -> list[int]:
    """Wrap the runner's launch (this script's own probe, not the plugin's) to compare the
    compiled tail's greedy ids with the tokens the host sampled. Returns [checked, wrong]."""
    runner = llm.engine.runner
    step = runner.step_runner
    launch = runner.launch
    counts = [0, 0]

    def checked(batch, prev=None):
        sampling = [
            i
            for i, (r, n) in enumerate(zip(batch.reqs, batch.num_new))
            if r.num_computed_tokens + n >= r.num_tokens
        ]
        handle = launch(batch, prev)
        tokens, _ = handle.result()
        device = [step.last_greedy[i] for i in sampling]
        counts[0] += len(tokens)
        counts[1] += sum(a != b for a, b in zip(device, tokens))
        return handle

    runner.launch = checked
    return counts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=50)
    args = ap.parse_args()
    logging.getLogger("paged").setLevel(logging.ERROR)  # the tiny model has no tokenizer

    import torch_xla
    import torch_xla.debug.metrics as met

    from paged import LLM

    def compiles() -> int:
        return met.counter_value("UncachedCompile") or 0

    print(f"torch {torch.__version__}, torch_xla {torch_xla.__version__}, PJRT_DEVICE=CPU")
    prompts, lens = workload(args.requests)
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_llama(os.path.join(tmp, "llama"))
        t0 = time.perf_counter()
        ref = generate(LLM(path, platform="cpu", **ENGINE), prompts, lens)
        t_cpu = time.perf_counter() - t0

        t0 = time.perf_counter()
        llm = LLM(path, platform="tpu", **ENGINE)
        t_start = time.perf_counter() - t0
        at_start = compiles()
        greedy = watch_device_greedy(llm)
        t0 = time.perf_counter()
        got = generate(llm, prompts, lens)
        t_run = time.perf_counter() - t0
        total = compiles()
        buckets = llm.engine.runner.step_runner.buckets
        preempted = llm.engine.scheduler.num_preemptions
        llm.engine.kv.check_invariants()

    same = sum(a == b for a, b in zip(ref, got))
    tokens = sum(len(o) for o in got)
    print(
        f"requests {len(prompts)}: {same} token-identical to the cpu plugin "
        f"({tokens} tokens, {preempted} preemptions; cpu {t_cpu:.1f} s, "
        f"xla start-up {t_start:.1f} s, run {t_run:.1f} s)"
    )
    print(f"device greedy ids: {greedy[0] - greedy[1]}/{greedy[0]} equal to the host's tokens")
    print(
        f"XLA compilations: {at_start} at start-up, {total - at_start} while serving; "
        f"buckets: tokens {buckets.tokens} + requests {buckets.reqs} = {buckets.count}"
    )
    for i, (a, b) in enumerate(zip(ref, got)):
        if a != b:
            print(f"  request {i} (prompt {len(prompts[i])}): cpu {a} != xla {b}")
            break
    ok = (
        same == len(prompts)
        and greedy[1] == 0
        and greedy[0] == tokens
        and total - at_start == 0
        and total <= buckets.count
    )
    print("check_xla: " + ("ok" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
