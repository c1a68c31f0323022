"""Sliding-window KV release on a GPU: a Mistral-7B shape (window 4096) with long prompts, the
blocks that fall out of the window released vs kept, same engine settings, same run.

    python bench/sliding_window_kv.py [--num-prompts 64] [--input-len 16384] [--max-tokens 128]
        [--kv-cache-memory 24GiB] [--window 4096] [--model mistral-7b|gemma-3-12b]

--model gemma-3-12b takes the Gemma 3 12B shape instead (5 sliding-window layers of 1024 to
1 global; --window is its own): "released" runs its six KV-cache groups (model/kv_groups.py:
a block id costs 8 layers, the windowed groups release), "kept" one group of all 48 layers
keeping every block, as before the groups. Its KV blocks then differ in bytes: compare the
most sequences running, the preemptions and the tokens/s, not the block counts.

Random weights (--load-format dummy) in the real shape; prompts are random token ids. "kept"
runs the same model with the release switched off in the engine (the layers still attend
within the window, so the kernels do the same work): the difference is only how many
sequences the KV pool holds at once. Reports per mode: peak blocks one sequence held, most
sequences running at once, preemptions, blocks released, output tokens/s and the wall time.
Appends a table to bench/results/sliding_window.md.
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from common import write_results  # noqa: E402  (bench/ is the script's directory)

from paged import SamplingParams  # noqa: E402
from paged.config import EngineConfig  # noqa: E402

MISTRAL_7B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=32000,
    max_position_embeddings=32768,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


SMALL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64)  # fmt: skip


def shape_dir(path: Path, window: int, small: bool) -> str:
    from safetensors.torch import save_file
    from transformers import MistralConfig

    shape = {**MISTRAL_7B, **(SMALL if small else {})}
    cfg = MistralConfig(**shape, sliding_window=window)
    cfg.architectures = ["MistralForCausalLM"]
    path.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(path)
    save_file({}, str(path / "model.safetensors"))
    return str(path)


def gemma_dir(path: Path, small: bool) -> str:
    from safetensors.torch import save_file

    from paged.model.shapes import shape_config

    cfg = shape_config("gemma-3-12b")
    if small:
        for key, value in {**SMALL, "num_hidden_layers": 6, "vocab_size": 32000}.items():
            setattr(cfg, key, value)
        cfg.layer_types = cfg.layer_types[:6]
    path.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(path)
    save_file({}, str(path / "model.safetensors"))
    return str(path)


def keep_every_block(hf_config, layers, max_model_len, start_layer=0):
    """One global KV-cache group of every layer: blocks are never released (the layers
    still attend within their windows)."""
    from paged.model.kv_groups import KVGroups

    return KVGroups((None,), (tuple(range(hf_config.num_hidden_layers)),))


def run(model: str, args, release: bool) -> dict:
    import paged.worker.model_runner as runner_mod
    from paged.engine.core import EngineCore

    originals = runner_mod.kv_groups, runner_mod.one_group
    if not release:  # the engine keeps every block
        runner_mod.kv_groups = runner_mod.one_group = keep_every_block
    try:
        engine = EngineCore(
            EngineConfig(
                model=model,
                load_format="dummy",
                runner="generate",  # dummy weights: no checkpoint to tell it has an LM head
                dtype=args.dtype,
                max_model_len=args.input_len + args.max_tokens + 16,
                kv_cache_memory=args.kv_cache_memory,
                max_num_seqs=args.num_prompts,
            )
        )
    finally:
        runner_mod.kv_groups, runner_mod.one_group = originals
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for i in range(args.num_prompts):
        prompt = [rng.randrange(3, 32000) for _ in range(args.input_len)]
        engine.add_request(f"r{i}", prompt, params)
    most, generated = 0, 0
    t = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            generated += len(out.new_token_ids)
        most = max(most, len(engine.scheduler.running))
    wall = time.perf_counter() - t
    kv = engine.kv
    whole = -(-(args.input_len + args.max_tokens) // kv.block_size)  # kept: the whole sequence
    result = {
        "blocks": engine.num_blocks,
        "peak_seq_blocks": kv.peak_seq_blocks if release else whole,
        "most_running": most,
        "preemptions": engine.scheduler.num_preemptions,
        "released": kv.num_window_released,
        "tok_s": generated / wall,
        "wall_s": wall,
    }
    kv.check_invariants([])
    engine.shutdown()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=16384)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--window", type=int, default=4096)
    ap.add_argument("--kv-cache-memory", default="24GiB")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--small", action="store_true", help="a tiny shape: check the script (CPU)")
    ap.add_argument("--model", choices=("mistral-7b", "gemma-3-12b"), default="mistral-7b")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "gemma-3-12b":
            model = gemma_dir(Path(tmp) / args.model, args.small)
        else:
            model = shape_dir(Path(tmp) / "mistral-7b", args.window, args.small)
        results = {mode: run(model, args, mode == "released") for mode in ("released", "kept")}
    print("| mode | KV blocks | peak blocks / seq | most running | preemptions | released "
          "| tok/s | wall s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for mode, r in results.items():
        cells = " | ".join(
            str(x) for x in (r["blocks"], r["peak_seq_blocks"], r["most_running"],
                             r["preemptions"], r["released"], f"{r['tok_s']:.1f}",
                             f"{r['wall_s']:.1f}")
        )  # fmt: skip
        print(f"| {mode} | {cells} |")
        rows.append((mode, cells.replace(" | ", ", ")))
    ratio = results["released"]["tok_s"] / results["kept"]["tok_s"]
    print(f"\nthroughput released / kept: {ratio:.2f}x")
    rows.append(("released / kept", f"{ratio:.2f}x output tokens/s"))
    shape = "tiny" if args.small else {"mistral-7b": "Mistral-7B"}.get(args.model, "Gemma-3-12B")
    window = 1024 if args.model == "gemma-3-12b" else args.window
    title = (f"Sliding-window KV release, {shape} shape, window {window}, "
             f"{args.num_prompts} x {args.input_len}/{args.max_tokens}")  # fmt: skip
    if args.small:  # a check of the script, not a figure
        return
    write_results("sliding_window.md", title, rows, {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
