"""Embeddings: paged's LLM.embed against HF transformers' AutoModel on the same random weights.

    python bench/embeddings.py [--model qwen3-8b] [--num-prompts 1000] [--input-len 512]
        [--hf-batch 32] [--pooling LAST] [--dtype bfloat16] [--skip-hf]

The named shape (paged.model.shapes) is built as a bare decoder (Qwen3Model / LlamaModel, the
Qwen3-Embedding layout: no LM head), randomly initialised in --dtype, saved to a temporary
directory and loaded by both. Prompts are random token ids of --input-len tokens each, so HF
needs no padding. Prints a markdown table: prompts/s and prompt tokens/s of each, and the
smallest cosine similarity between paged's and HF's vectors (both pooled the same way and
L2-normalised). Results go to bench/results/ by hand.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from paged import LLM  # noqa: E402
from paged.model.shapes import shape_config  # noqa: E402
from paged.pooling_params import PoolingParams  # noqa: E402


def save_bare_decoder(name: str, dtype: torch.dtype, path: str, device: str) -> None:
    import transformers

    cfg = shape_config(name)
    arch = cfg.architectures[0].removesuffix("ForCausalLM") + "Model"
    cfg.architectures = [arch]
    torch.manual_seed(0)
    with torch.device(device):
        model = getattr(transformers, arch)(cfg).to(dtype)
    model.save_pretrained(path, safe_serialization=True)


def hf_embed(path: str, prompts: list[list[int]], kind: str, batch: int, dtype, device: str):
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path, dtype=dtype).to(device).eval()
    out = []
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            ids = torch.tensor(prompts[i : i + batch], device=device)
            h = model(ids).last_hidden_state.float()
            v = {"LAST": h[:, -1], "MEAN": h.mean(1), "CLS": h[:, 0]}[kind]
            out.append(torch.nn.functional.normalize(v, dim=-1).cpu())
    sync()
    return torch.cat(out), time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--hf-batch", type=int, default=32)
    ap.add_argument("--pooling", default="LAST", choices=("LAST", "MEAN", "CLS"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    vocab = shape_config(args.model).vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, vocab, (args.num_prompts, args.input_len), generator=g).tolist()
    with tempfile.TemporaryDirectory() as path:
        save_bare_decoder(args.model, dtype, path, device)
        llm = LLM(path, dtype=args.dtype, max_model_len=max(args.input_len, 1024))
        assert llm.engine.config.runner == "pooling"
        params = PoolingParams(pooling_type=args.pooling)
        llm.embed(prompts[:8], pooling_params=params, use_tqdm=False)  # warm-up
        t0 = time.perf_counter()
        out = llm.embed(prompts, pooling_params=params, use_tqdm=False)
        paged_s = time.perf_counter() - t0
        ours = torch.tensor([o.outputs.embedding for o in out])
        del llm
        rows = [("paged", paged_s)]
        cos = None
        if not args.skip_hf:
            ref, hf_s = hf_embed(path, prompts, args.pooling, args.hf_batch, dtype, device)
            rows.append((f"HF AutoModel (batch {args.hf_batch})", hf_s))
            cos = torch.nn.functional.cosine_similarity(ours, ref, dim=-1).min().item()
    n, tokens = args.num_prompts, args.num_prompts * args.input_len
    print(f"\n{args.model} ({args.dtype}), {n} prompts x {args.input_len} tokens, "
          f"{args.pooling} pooling, {device}\n")  # fmt: skip
    print("| engine | s | prompts/s | prompt tokens/s |")
    print("|---|---|---|---|")
    for name, s in rows:
        print(f"| {name} | {s:.2f} | {n / s:.1f} | {tokens / s:.0f} |")
    if cos is not None:
        print(f"\nmin cosine similarity paged vs HF: {cos:.5f}")


if __name__ == "__main__":
    main()
