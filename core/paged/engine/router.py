"""Routing policies for a ReplicaSet (`--router prefix|least-load|round-robin`).

A policy picks one replica for a request among those that can hold it (max_model_len at least
the prompt plus max_tokens); it never picks one too small (`too_long` when none fits). What it
reads of a replica (replicas.Replica): `load` (outstanding tokens), `speed` and
`prefill_speed` (tokens/s EWMAs learnt from the outputs it returned), `prefix` (a PrefixIndex:
the chained hashes of the full blocks of the prompts it was sent) and `stats` (the engine's
counters: prefix-cache queries and hits, in prompt tokens).

- least-load: the least outstanding work; ties take turns.
- round-robin: turns, whatever the load.
- prefix (default): the shortest expected wait, load / speed, minus the prefill time its
  cached prefix saves, hit blocks x block size / the replica's uncached prefill speed; ties
  take turns.

Both speeds count every prompt token, cached or not, as does `load`. The wait is consistent
(nominal tokens over nominal tokens/s), but a cached block saves the time of computing it, at
the speed of the tokens a replica computes itself: its nominal prefill speed times the share
of prompt tokens it did not find cached (1 - its own prefix-cache hit rate, from the engine's
counters). Without that, the more a replica's prompts hit, the faster it seems to prefill
and the less its cached blocks weigh: affinity undoes itself. Until a replica's throughput
is measured, its prefill speed stands in for it (a lower bound: time to first token
includes the wait behind others); a constant would not be in the same units as the other.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

POLICIES = ("prefix", "least-load", "round-robin")
DEFAULT_SPEED = 1000.0  # tokens/s assumed until a replica has been measured
MIN_UNCACHED = 0.05  # floor of a replica's uncached share, so that one whose prompts nearly
# all hit its cache does not value a cached block without bound
BLOCK = 16  # tokens per hashed prefix block when a replica does not say


def block_hashes(prompt_ids: Sequence[int], block_size: int = BLOCK) -> list[int]:
    """Chained hashes of the full blocks of a prompt: block k's hash covers blocks 0..k."""
    out, h = [], 0
    for i in range(0, len(prompt_ids) - block_size + 1, block_size):
        h = hash((h, tuple(prompt_ids[i : i + block_size])))
        out.append(h)
    return out


class PrefixIndex:
    """The block hashes a replica was sent, least recently used first, at most `capacity`
    (its KV cache in blocks: what it can have cached at best)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(capacity, 0)
        self._lru: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def hits(self, hashes: Sequence[int]) -> int:
        """Leading blocks of the prompt this replica was sent before."""
        n = 0
        for h in hashes:
            if h not in self._lru:
                break
            n += 1
        return n

    def add(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            self._lru[h] = None
            self._lru.move_to_end(h)
        while len(self._lru) > self.capacity:
            self._lru.popitem(last=False)


def fits(replica: Any, prompt_len: int, max_tokens: int | None) -> bool:
    """The replica's context holds the prompt and max_tokens (at least one token)."""
    limit = (replica.info or {}).get("max_model_len")
    return limit is None or prompt_len + (max_tokens or 1) <= limit


def too_long(prompt_len: int, max_tokens: int | None, limit: int) -> Exception:
    """What the server answers a request that no replica can hold (the largest holds `limit`
    tokens): its 400 context_length_exceeded naming the field, as for a single engine
    (Serving.fit). An APIError (paged.server.errors), raised as is through the server."""
    want = max_tokens or 1
    if prompt_len >= limit:
        field = "prompt"
        msg = (
            f"prompt: this model's maximum context length is {limit} tokens, but the "
            f"prompt has {prompt_len} tokens (at least one must be left for the output)"
        )
    else:
        field = "max_tokens"
        msg = (f"max_tokens: this model's maximum context length is {limit} tokens, but "
               f"{prompt_len + want} were requested ({prompt_len} in the prompt, {want} in the "
               "completion); reduce the prompt or max_tokens")  # fmt: skip
    try:
        from paged.server.errors import APIError
    except ImportError:  # no server here: the field still leads the message
        return ValueError(msg)
    return APIError(400, msg, field, "context_length_exceeded")


def uncached_share(replica: Any) -> float:
    """The share of the prompt tokens the replica looked up that it computed itself."""
    stats = replica.stats or {}
    queries = stats.get("prefix_cache_queries", 0)
    if not queries:
        return 1.0
    return max(1.0 - stats.get("prefix_cache_hits", 0) / queries, MIN_UNCACHED)


class Router:
    """One policy; `pick` is called once per request with the candidates in index order."""

    def __init__(self, policy: str = "least-load") -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown router {policy!r}: {' | '.join(POLICIES)}")
        self.policy = policy
        self._next = 0  # where ties (and round-robin) start

    def _turn(self, n: int) -> int:
        start = self._next % n
        self._next = (start + 1) % n
        return start

    def score(self, replica: Any, hashes: Sequence[int]) -> float:
        """prefix: expected seconds until the request is served on this replica."""
        prefill = replica.prefill_speed or DEFAULT_SPEED
        wait = replica.load / (replica.speed or prefill)
        hit = replica.prefix.hits(hashes) if hashes else 0
        return wait - hit * BLOCK / (prefill * uncached_share(replica)) if hit else wait

    def pick(
        self,
        replicas: Sequence[Any],
        prompt_ids: Sequence[int],
        max_tokens: int | None,
        hashes: list[int] | None = None,
    ):
        """The replica for this request. Those too small for it are never picked: when none
        can hold it, the 400 of `too_long` is raised. `hashes`: the prompt's block_hashes,
        when the caller has them already."""
        n = len(replicas)
        ok = [r for r in replicas if fits(r, len(prompt_ids), max_tokens)]
        if not ok:
            limit = max((r.info or {}).get("max_model_len") or 0 for r in replicas)
            raise too_long(len(prompt_ids), max_tokens, limit)
        start = self._turn(n)
        ring = sorted(ok, key=lambda r: (replicas.index(r) - start) % n)  # turns on ties
        if self.policy == "round-robin":
            return ring[0]
        if self.policy == "least-load":
            return min(ring, key=lambda r: r.load)
        if hashes is None:
            hashes = block_hashes(prompt_ids)
        return min(ring, key=lambda r: self.score(r, hashes))
