"""N-gram prompt lookup: propose the tokens that followed the last earlier occurrence of the
sequence's newest n tokens (n from prompt_lookup_max down to prompt_lookup_min), on the host."""

from __future__ import annotations

import numpy as np


def ngram_propose(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` tokens proposed to follow `tokens` (prompt + output), [] without a match.
    The longest suffix n-gram wins; among its earlier occurrences the most recent. Only the
    positions holding the newest token are candidates, narrowed one token back at a time."""
    t = len(tokens)
    if k <= 0 or t < min_n + 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    ends = np.flatnonzero(arr[: t - 1] == arr[-1])  # earlier ends of a 1-gram match
    found: list[np.ndarray] = [ends]  # found[m]: ends matching the newest m + 1 tokens
    for m in range(1, min(max_n, t - 1)):
        prev = found[-1]
        prev = prev[prev >= m]
        nxt = prev[arr[prev - m] == arr[t - 1 - m]]
        if not nxt.size:
            break
        found.append(nxt)
    for n in range(len(found), min_n - 1, -1):
        if n <= len(found) and found[n - 1].size:
            start = int(found[n - 1][-1]) + 1
            return arr[start : start + k].tolist()
    return []
