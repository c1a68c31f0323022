"""Logprobs in OpenAI's two shapes: completions (legacy lists) and chat (`content` entries).

The engine gives one {token id: logprob} per generated token: the sampled token plus the
top-n of the raw distribution. -inf is clamped to -9999.0, as JSON has no infinities.
"""

from __future__ import annotations

import re
from functools import cache
from typing import Any

FLOOR = -9999.0
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


def _text(tok: Any, token_id: int) -> str:
    return tok.decode([token_id]) if tok is not None else str(token_id)


@cache
def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character standing for each byte."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]  # fmt: skip
    chars, extra = {}, 0
    for b in range(256):
        if b in kept:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


@cache
def _pieces(tok: Any) -> tuple[bool, frozenset[int]]:
    """Once per tokenizer: whether its pieces spell bytes in GPT-2's alphabet (Llama 3, Qwen,
    GPT-2), and its special tokens' ids."""
    decoder = getattr(getattr(tok, "backend_tokenizer", None), "decoder", None)
    return "ByteLevel" in repr(decoder), frozenset(getattr(tok, "all_special_ids", ()))


def token_bytes(tok: Any, token_id: int) -> list[int]:
    """The token's own bytes (OpenAI's `bytes`): a piece of a multi-byte character gives its
    bytes, not those of the replacement character its decoded text shows."""
    raw = tok.convert_ids_to_tokens(token_id) if tok is not None else None
    byte_level, special = _pieces(tok) if tok is not None else (False, frozenset())
    if isinstance(raw, str) and token_id not in special:
        table = _unicode_to_byte()
        if byte_level and all(c in table for c in raw):
            return [table[c] for c in raw]
        if m := _BYTE_PIECE.fullmatch(raw):
            return [int(m.group(1), 16)]
    return list(_text(tok, token_id).encode("utf-8"))


def _top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: -kv[1])[:k]


def _lp(value: float | None) -> float:
    return FLOOR if value is None or value < FLOOR else value


class CompletionLogprobs:
    """Accumulates {tokens, token_logprobs, top_logprobs, text_offset} of one choice."""

    def __init__(self, tok: Any, k: int, offset: int = 0) -> None:
        self.tok, self.k, self.offset = tok, k, offset

    def make(self, token_ids: list[int], entries: list[dict[int, float]]) -> dict[str, Any]:
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
        out["text_offset"] = []
        for tid, entry in zip(token_ids, entries):
            s = _text(self.tok, tid)
            out["tokens"].append(s)
            out["token_logprobs"].append(_lp(entry.get(tid)))
            # The k most likely tokens and the sampled one (so logprobs=0 gives just it).
            top = {_text(self.tok, t): _lp(v) for t, v in _top(entry, self.k)}
            top.setdefault(s, _lp(entry.get(tid)))
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(s)
        return out

    def make_prompt(self, token_ids: list[int], entries: list[dict[int, float]]) -> dict[str, Any]:
        """The echoed prompt's part: the first token has no logprob (None), as in OpenAI."""
        first = _text(self.tok, token_ids[0])
        head = {"tokens": [first], "token_logprobs": [None], "top_logprobs": [None]}
        head["text_offset"] = [self.offset]
        self.offset += len(first)
        return join_logprobs(head, self.make(token_ids[1:], entries))


def join_logprobs(a: dict[str, list], b: dict[str, list]) -> dict[str, list]:
    return {k: a[k] + b[k] for k in a}


def prompt_logprobs(
    tok: Any, token_ids: list[int], entries: list[dict[int, float]], ranks: list[int]
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's prompt_logprobs: None for the first token, then {token id: {logprob, rank,
    decoded_token}} with the prompt token and the top-k (ranked by value)."""
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for tid, entry, rank in zip(token_ids[1:], entries, ranks):
        order = sorted(entry, key=lambda t: -entry[t])
        d = {}
        for t in [tid, *order]:
            if str(t) not in d:
                r = rank if t == tid else order.index(t) + 1
                d[str(t)] = {"logprob": _lp(entry[t]), "rank": r, "decoded_token": _text(tok, t)}
        out.append(d)
    return out


def chat_logprobs(
    tok: Any, k: int, token_ids: list[int], entries: list[dict[int, float]]
) -> dict[str, Any]:
    """{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}"""

    def item(tid: int, value: float | None) -> dict[str, Any]:
        s = _text(tok, tid)
        return {"token": s, "logprob": _lp(value), "bytes": token_bytes(tok, tid)}

    content = []
    for tid, entry in zip(token_ids, entries):
        e = item(tid, entry.get(tid))
        e["top_logprobs"] = [item(t, v) for t, v in _top(entry, k)]
        content.append(e)
    return {"content": content}


class Pending:
    """Per choice, the (token ids, logprob entries) generated but not streamed yet."""

    def __init__(self) -> None:
        self.items: dict[int, tuple[list[int], list[dict[int, float]]]] = {}

    def add(self, index: int, token_ids: list[int], entries: list | None) -> None:
        if entries:
            ids, lps = self.items.setdefault(index, ([], []))
            ids.extend(token_ids)
            lps.extend(entries)

    def take(self, index: int) -> tuple[list[int], list[dict[int, float]]]:
        return self.items.pop(index, ([], []))
