"""N-gram prompt lookup: propose the tokens that followed the last earlier occurrence of the
sequence's newest n tokens (n from prompt_lookup_max down to prompt_lookup_min), on the host."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def ngram_propose(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` tokens proposed to follow `tokens` (prompt + output), [] without a match.
    The longest suffix n-gram wins; among its earlier occurrences the most recent."""
    t = len(tokens)
    if k <= 0 or t < min_n + 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, t - 1), min_n - 1, -1):
        # windows starting at 0 .. t-n-1 (the suffix itself excluded)
        windows = sliding_window_view(arr[: t - 1], n)
        hits = np.flatnonzero((windows == arr[t - n :]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start : start + k].tolist()
    return []
