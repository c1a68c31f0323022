"""BlockRows keeps block tables between steps: only appended ids are converted, and a
request's whole row again when the KV manager changed blocks it listed. The tables it gives
must equal the requests' lists at every step, whatever the manager did in between."""

from __future__ import annotations

import numpy as np

from paged.engine.kv_cache import KVCacheManager
from paged.engine.request import Request
from paged.sampling.params import SamplingParams
from paged.worker.input_buffers import BlockRows


def expected(reqs: list[Request], groups: int, width: int) -> np.ndarray:
    want = np.zeros((groups, len(reqs), width), dtype=np.int32)
    for i, r in enumerate(reqs):
        for g, ids in enumerate(r.group_block_ids):
            want[g, i, : len(ids)] = ids
    return want


def request(i: int, n: int) -> Request:
    return Request(f"r{i}", list(range(100, 100 + n)), SamplingParams(temperature=0, max_tokens=64))


def check(rows: BlockRows, reqs: list[Request], groups: int) -> None:
    width = max(len(r.block_ids) for r in reqs)
    assert np.array_equal(rows.table(reqs, width), expected(reqs, groups, width))


def test_tables_follow_appends_releases_copies_trims_and_frees():
    kv = KVCacheManager(200, 4, enable_prefix_caching=False, group_windows=[None, 6])
    rows = BlockRows(2, capacity=3)  # fewer rows than requests seen: rows are reused
    a, b = request(0, 10), request(1, 3)
    for r in (a, b):
        assert kv.allocate(r, r.num_tokens)
    check(rows, [a, b], 2)
    for _ in range(12):  # decodes: appends, and the windowed group releases (null block)
        for r in (a, b):
            r.num_computed_tokens = r.num_tokens
            r.token_ids.append(7)
            assert kv.allocate(r, r.num_tokens)
        check(rows, [a, b], 2)
    assert kv.num_window_released > 0
    assert kv.allocate(a, a.num_tokens + 5)  # lookahead slots, then given back and new ones
    check(rows, [a, b], 2)
    kv.trim(a, a.num_tokens)
    assert kv.allocate(b, b.num_tokens + 9)  # b takes the freed blocks
    assert kv.allocate(a, a.num_tokens + 5)  # a's same positions, other blocks
    check(rows, [b, a], 2)
    kv.free_request(a)  # preempted: computed again later, from other blocks
    c, d = request(2, 17), request(3, 5)
    for r in (c, d):
        assert kv.allocate(r, r.num_tokens)
    a.num_computed_tokens = 0
    assert kv.allocate(a, 9)
    check(rows, [c, a, d], 2)  # a fourth request: rows of those not in the step reused
    check(rows, [b], 2)


def test_a_view_without_a_version_is_read_whole_every_step():
    class View:
        def __init__(self, rid: str, ids: list[int]) -> None:
            self.request_id, self.block_ids = rid, ids

        group_block_ids = property(lambda self: [self.block_ids])

    rows = BlockRows(1, capacity=2)
    v = View("x", [5, 6, 7])
    check(rows, [v], 1)
    v.block_ids[1] = 9  # changed in place, no version to say so
    check(rows, [v], 1)
    v.block_ids = [1]
    check(rows, [v], 1)
