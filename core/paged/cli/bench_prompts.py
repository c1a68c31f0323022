"""Prompts for ``paged bench serve``: random token ids or text, or a JSONL dataset."""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path

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
    """Lines {"prompt": text or ids, "output_len" or "max_tokens": N} or JSON strings; a
    ValueError naming the file (and the line) for one that cannot be read or used."""
    path = args.dataset
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"--dataset: cannot read {path}: {e.strerror or e}") from None
    out = []
    for i, raw in enumerate(data.split(b"\n"), 1):
        if not raw.strip():
            continue
        where = f"--dataset: {path} line {i}"
        try:
            rec = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise ValueError(f"{where}: not UTF-8 ({e.reason})") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
        rec = {"prompt": rec} if isinstance(rec, str) else rec
        p = rec.get("prompt") if isinstance(rec, dict) else None
        ids = isinstance(p, list) and all(type(t) is int and t >= 0 for t in p)
        if not p or not (isinstance(p, str) or ids):
            raise ValueError(f"{where}: needs a 'prompt': a non-empty string or token ids")
        n_out = rec.get("output_len", rec.get("max_tokens"))
        if n_out is None:
            n_out = args.random_output_len
        elif type(n_out) is not int or n_out < 1:
            raise ValueError(f"{where}: output_len / max_tokens must be at least 1, not {n_out!r}")
        out.append(Prompt(p, len(p) if ids else len(p.split()), n_out))
    if not out:
        raise ValueError(f"--dataset: {path} holds no prompts")
    rng = random.Random(args.seed)
    # --num-prompts of them, cycling through the file when it is shorter
    order = [out[i % len(out)] for i in range(args.num_prompts)]
    rng.shuffle(order)
    return order
