"""Block pool unit tests: refcounts, prefix hits, LRU eviction, collision safety."""

from __future__ import annotations

from paged.engine.kv_cache import KVCacheManager
from paged.engine.request import Request
from paged.sampling.params import SamplingParams


def req(rid: str, ids: list[int]) -> Request:
    return Request(rid, ids, SamplingParams())


def compute(kv: KVCacheManager, r: Request) -> None:
    cached = kv.find_cached(r)
    assert kv.allocate(r, r.num_tokens, cached)
    r.num_computed_tokens = r.num_tokens
    kv.cache_full_blocks(r)


def test_prefix_hit_shares_blocks_and_refcounts():
    kv = KVCacheManager(8, 4)
    a, b = req("a", list(range(10))), req("b", list(range(9)) + [99])
    compute(kv, a)
    assert len(a.block_ids) == 3
    cached = kv.find_cached(b)
    assert [c.block_id for c in cached] == a.block_ids[:2]
    assert kv.allocate(b, b.num_tokens, cached)
    assert kv.blocks[a.block_ids[0]].ref_cnt == 2
    kv.check_invariants([a, b])
    kv.free_request(a)
    kv.free_request(b)
    kv.check_invariants([])
    assert kv.num_free_blocks == 8


def test_freed_blocks_stay_cached_until_evicted():
    kv = KVCacheManager(4, 4)
    a = req("a", list(range(9)))
    compute(kv, a)
    kv.free_request(a)
    again = req("a2", list(range(9)))
    assert len(kv.find_cached(again)) == 2
    # Filling the pool with other content evicts the cached blocks (LRU first).
    other = req("o", list(range(100, 116)))
    compute(kv, other)
    assert len(kv.find_cached(req("a3", list(range(9))))) < 2
    kv.free_request(other)
    kv.check_invariants([])


def test_at_least_one_token_is_computed():
    kv = KVCacheManager(8, 4)
    a = req("a", list(range(8)))
    compute(kv, a)
    b = req("b", list(range(8)))
    assert len(kv.find_cached(b)) == 1  # the last block must be recomputed for logits


def test_hash_collision_is_checked_against_tokens():
    kv = KVCacheManager(8, 4)
    a = req("a", list(range(9)))
    compute(kv, a)
    # Forge a collision: make a's first block claim the hash that b's first block will have.
    b = req("b", [7, 7, 7, 7, 1])
    h = kv._hash_blocks(b, 4)[0]
    blk = kv.blocks[a.block_ids[0]]
    kv.cached[h] = blk
    assert kv.find_cached(b) == []


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(2, 4)
    a = req("a", list(range(20)))
    assert not kv.allocate(a, 20)
    assert a.block_ids == [] and kv.num_free_blocks == 2
    kv.check_invariants([])
