"""Prompts for ``paged bench serve``: random token ids or text, or a JSONL dataset."""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass

_TEXT = """time person year way day thing man world life hand part child eye woman place work
week case point government company number group problem fact river stone light music garden
window paper story water city market letter table forest engine"""
WORDS = _TEXT.split()


@dataclass
class Prompt:
    prompt: str | list[int]
    prompt_len: int  # tokens (approximate for text until the server's usage tells)
    output_len: int


def _lengths(rng: random.Random, base: int, ratio: float) -> int:
    lo, hi = max(1, int(base * (1 - ratio))), max(1, int(base * (1 + ratio)))
    return rng.randint(lo, hi)


def _token_pool(args: argparse.Namespace, rng: random.Random) -> list[int] | None:
    """Valid token ids: [0, --vocab-size), else what the server's /tokenize gives for words."""
    if args.vocab_size:
        return list(range(args.vocab_size))
    import httpx

    root = args.url.rstrip("/").removesuffix("/v1")
    text = " ".join(rng.choice(WORDS) for _ in range(400))
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        r = httpx.post(
            f"{root}/tokenize",
            json={"prompt": text, "add_special_tokens": False},
            headers=headers,
            timeout=30,
        )
        r.raise_for_status()
        return sorted(set(r.json()["tokens"])) or None
    except (httpx.HTTPError, KeyError, TypeError, ValueError):
        return None


def random_prompts(args: argparse.Namespace) -> list[Prompt]:
    rng = random.Random(args.seed)
    pool = _token_pool(args, rng)
    out = []
    for _ in range(args.num_prompts):
        n_in = _lengths(rng, args.random_input_len, args.random_range_ratio)
        n_out = _lengths(rng, args.random_output_len, args.random_range_ratio)
        if pool:
            out.append(Prompt([rng.choice(pool) for _ in range(n_in)], n_in, n_out))
        else:  # roughly one token per word
            out.append(Prompt(" ".join(rng.choice(WORDS) for _ in range(n_in)), n_in, n_out))
    return out


def dataset_prompts(args: argparse.Namespace) -> list[Prompt]:
    """Lines {"prompt": text or ids, "output_len" or "max_tokens": N} or JSON strings."""
    out = []
    with open(args.dataset, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            rec = json.loads(line)
            rec = {"prompt": rec} if isinstance(rec, str) else rec
            p = rec.get("prompt") if isinstance(rec, dict) else None
            if not p:
                raise ValueError(f"{args.dataset}:{i}: each line needs a 'prompt'")
            n_out = rec.get("output_len") or rec.get("max_tokens") or args.random_output_len
            n_in = len(p) if isinstance(p, list) else len(p.split())
            out.append(Prompt(p, n_in, int(n_out)))
    if not out:
        raise ValueError(f"{args.dataset} holds no prompts")
    rng = random.Random(args.seed)
    # --num-prompts of them, cycling through the file when it is shorter
    order = [out[i % len(out)] for i in range(max(args.num_prompts, 1))]
    rng.shuffle(order)
    return order


def load_prompts(args: argparse.Namespace) -> list[Prompt]:
    return dataset_prompts(args) if args.dataset else random_prompts(args)
