"""The KV block pool: reference counts, a free list in LRU order, and prefix caching.

A full block is identified by a hash chain (parent hash, its token ids); a hit is
checked against the stored token ids, so a hash collision can never serve wrong K/V.
Freed blocks keep their hash until reused, so a later request with the same prefix
finds them again; eviction takes the least recently freed block first.

Sequences forked from one prompt (n > 1) share its blocks. A shared block is never written:
a sequence about to write into one (the prompt's partial last block) gets a fresh block and a
copy of it (`copies`, run on the device before the step's forward), copy on write.

Sliding windows (`window`: every attention layer of the model attends to at most its last
`window` positions): the blocks no future query of a sequence can read are released as it
advances, and its block table keeps the reserved null block (`null_block`, never allocated or
written) at their positions; the attention kernels never read positions outside the window.
With prefix caching a block is released once registered (it stays cached, evictable), and a
prefix hit needs only the blocks within the window of its first computed token.

KV-cache groups (`group_windows`: models mixing windowed and global layers, model/kv_groups.py):
a request holds a block list per group (`Request.group_block_ids`, all of the same length)
from the one pool; each group releases by its own window (a global group keeps every block),
caches its blocks under its own keys, and a prefix hit is the longest prefix every group can
serve. One group (`window`) is the plain case above.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from paged.engine.request import Request


class Block:
    __slots__ = ("block_id", "ref_cnt", "hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.hash: int | tuple[int, int] | None = None  # its key in `cached`
        self.token_ids: tuple[int, ...] | None = None  # for collision checks


Hit = list[Block | None]  # one group's blocks of a prefix hit (None: the null block)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        window: int | None = None,
        group_windows: Sequence[int | None] | None = None,
    ):
        """`window`: one group whose layers all have it; `group_windows`: one window (or None,
        global) per KV-cache group instead."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[int | tuple[int, int], Block] = {}  # key -> block holding that block
        self.req_hashes: dict[str, list[int]] = {}  # request id -> hashes of its full blocks
        self.req_registered: dict[str, int] = {}  # request id -> full blocks already cached
        self.copies: list[tuple[int, int]] = []  # (source, destination) for the next step
        self.windows: list[int | None] = list(group_windows or [window])
        self.windowed = [g for g, w in enumerate(self.windows) if w is not None]
        # Sliding windows: block 0 is the null block, the placeholder for released positions.
        self.null_block: int | None = None
        if any(w is not None for w in self.windows):
            self.null_block = 0
            del self.free[0]
        self.req_released: dict[str, list[int]] = {}  # request id -> per group, leading
        self.reset_counters()  # positions released

    @property
    def window(self) -> int | None:
        """The window when every group has one (the largest), else None."""
        if any(w is None for w in self.windows):
            return None
        return max(self.windows)

    def reset_counters(self) -> None:
        """The counters /metrics reports, as at start (also after the start-up warm-up)."""
        self.queries = 0  # prefix-cache lookups (tokens) and hits (tokens), for metrics
        self.hits = 0
        self.num_window_released = 0  # blocks released out of a window (counter)
        self.peak_seq_blocks = 0  # most blocks one sequence held at once (all groups)
        self.peak_group_blocks = [0] * len(self.windows)  # the same, per group

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - (self.null_block is not None)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        usable = self.num_usable_blocks
        return 1.0 - len(self.free) / usable if usable else 0.0

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _lists(self, req: Request) -> list[list[int]]:
        """`req`'s block list of each group (empty lists for a request holding none)."""
        if len(req.group_block_ids) != len(self.windows):
            assert not any(req.group_block_ids), "a request's blocks are of another group count"
            req.group_block_ids = [[] for _ in self.windows]
            req.block_version += 1
        return req.group_block_ids

    @staticmethod
    def _key(group: int, h: int) -> int | tuple[int, int]:
        """A block's prefix-cache key: the same tokens are another block in each group."""
        return h if group == 0 else (group, h)

    # ---- prefix cache -------------------------------------------------------------
    def _hash_blocks(self, req: Request, upto: int) -> list[int]:
        """Chain hashes of the request's full blocks covering its first `upto` tokens."""
        hashes = self.req_hashes.setdefault(req.request_id, [])
        bs = self.block_size
        parent = hashes[-1] if hashes else req.hash_seed  # the adapter's id
        for i in range(len(hashes), upto // bs):
            parent = hash((parent, tuple(req.token_ids[i * bs : (i + 1) * bs])))
            hashes.append(parent)
        return hashes

    def find_cached(self, req: Request) -> Hit:
        """Cached blocks of the longest cached prefix (the first group's: `find_hit` gives
        every group's); leaves at least one token to compute."""
        return self.find_hit(req)[0]

    def find_hit(self, req: Request) -> list[Hit]:
        """Per group, the cached blocks of the longest cached prefix every group can serve:
        a global group every block of it, a windowed group every block of the window of the
        first computed token (None before it; the chain hash makes each hit imply the whole
        prefix before it). All of one length; at least one token is left to compute."""
        none: list[Hit] = [[] for _ in self.windows]
        pooling = req.params.pooling
        if not self.enable_prefix_caching or req.params.prompt_logprobs is not None:
            return none  # prompt_logprobs need the logits of every prompt token
        if pooling is not None and pooling.needs_every_token:
            return none  # MEAN / CLS pooling: the hidden states of every prompt token
        hashes = self._hash_blocks(req, req.num_tokens - 1)
        return self._common_hit([self._lookup(req, g, hashes) for g in range(len(self.windows))])

    def _common_hit(self, found: list[Hit]) -> list[Hit]:
        """Per group, its part of the longest prefix every group can serve, from each group's
        `found` blocks (`_lookup`)."""
        servable = [self._servable(g, f) for g, f in enumerate(found)]
        best = max(n for n in range(min(map(len, servable))) if all(s[n] for s in servable))
        hit = []
        for g, blocks in enumerate(found):
            first = self._first_needed(g, best * self.block_size)
            hit.append([None] * first + blocks[first:best])
        return hit

    def _lookup(self, req: Request, group: int, hashes: list[int]) -> Hit:
        """The group's cached block (or None) of each hash; a global group stops at the first
        miss (it needs every block before its hit)."""
        bs, out = self.block_size, []
        for i, h in enumerate(hashes):
            blk = self.cached.get(self._key(group, h))
            if blk is None or blk.token_ids != tuple(req.token_ids[i * bs : (i + 1) * bs]):
                if self.windows[group] is None:
                    break
                blk = None
            out.append(blk)
        return out

    def _servable(self, group: int, found: Hit) -> list[bool]:
        """For n = 0..len(found): whether a hit of n blocks finds every block the group's
        first computed token reads."""
        ok, run = [True], 0
        for i, blk in enumerate(found):
            run = run + 1 if blk is not None else 0
            ok.append(run >= i + 1 - self._first_needed(group, (i + 1) * self.block_size))
        return ok

    def _first_needed(self, group: int, pos: int) -> int:
        """The first block a query at position `pos` (or later) can read in the group."""
        window = self.windows[group]
        return 0 if window is None else max(pos - window + 1, 0) // self.block_size

    def cache_full_blocks(self, req: Request, upto: int | None = None) -> None:
        """Register the request's full blocks among its first `upto` computed tokens (default:
        all computed) in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        upto = req.num_computed_tokens if upto is None else upto
        full = upto // bs
        hashes = self._hash_blocks(req, upto)
        done = self.req_registered.get(req.request_id, 0)
        for i in range(done, full):
            for g, ids in enumerate(req.group_block_ids):
                if ids[i] == self.null_block:  # released: it was registered before
                    continue
                key, blk = self._key(g, hashes[i]), self.blocks[ids[i]]
                if blk.hash is not None:
                    continue
                if key in self.cached:  # identical content already cached in another block
                    continue
                blk.hash, blk.token_ids = key, tuple(req.token_ids[i * bs : (i + 1) * bs])
                self.cached[key] = blk
        self.req_registered[req.request_id] = max(full, done)

    # ---- allocation ---------------------------------------------------------------
    def _take_free(self) -> Block:
        _, blk = self.free.popitem(last=False)  # least recently freed first
        if blk.hash is not None:  # evict its cached content
            if self.cached.get(blk.hash) is blk:
                del self.cached[blk.hash]
            blk.hash = blk.token_ids = None
        blk.ref_cnt = 1
        return blk

    def allocate(
        self, req: Request, total_tokens: int, cached: list[Hit] | Hit | None = None
    ) -> bool:
        """Make `req` hold blocks for its first `total_tokens` tokens in every group, taking
        the `cached` prefix blocks first (`find_hit`'s, or with one group `find_cached`'s;
        None: a position before the window, the null block). Returns False, changing nothing
        but the release of blocks out of the window, when the pool is short."""
        lists = self._lists(req)
        if self.windowed:
            self._release_out_of_window(req)
        want, computed = self.blocks_needed(total_tokens), req.num_computed_tokens
        shared_write = self._shared_write_block
        if (
            not cached
            and len(lists[0]) >= want
            and not any(shared_write(ids, computed, total_tokens) for ids in lists)
        ):
            return True  # a decode within its last block: nothing to take or copy
        hits = self._per_group(cached)
        need, shared = 0, []
        for ids, hit in zip(lists, hits):
            need += max(want - len(ids) - len(hit), 0)
            need += sum(1 for b in hit if b is not None and b.ref_cnt == 0)  # off the free list
            write = self._shared_write_block(ids, computed, total_tokens)
            if write is not None:
                shared.append((ids, *write))
        if need + len(shared) > len(self.free):
            return False
        for ids, i, blk in shared:  # copy on write
            new = self._take_free()
            blk.ref_cnt -= 1  # still held by the others: more than one held it
            ids[i] = new.block_id
            self.copies.append((blk.block_id, new.block_id))
        if shared:
            req.block_version += 1  # a listed block replaced
        for g, (ids, hit) in enumerate(zip(lists, hits)):
            for blk in hit:
                if blk is None:
                    ids.append(self.null_block)
                    continue
                if blk.ref_cnt == 0:
                    del self.free[blk.block_id]
                blk.ref_cnt += 1
                ids.append(blk.block_id)
            if hit and hit[0] is None:  # a hit past the window: its leading positions
                lead = next((i for i, b in enumerate(hit) if b is not None), len(hit))
                self._released(req)[g] = lead
            for _ in range(max(want - len(ids), 0)):
                ids.append(self._take_free().block_id)
        if self.null_block is not None:
            released = self.req_released.get(req.request_id, [0] * len(lists))
            held = [len(ids) - r for ids, r in zip(lists, released)]
            self.peak_seq_blocks = max(self.peak_seq_blocks, sum(held))
            self.peak_group_blocks = list(map(max, self.peak_group_blocks, held))
        return True

    def _per_group(self, cached: list[Hit] | Hit | None) -> list[Hit]:
        if not cached:
            return [[] for _ in self.windows]
        if isinstance(cached[0], list):
            return cached
        assert len(self.windows) == 1, "one group's hit with several groups: use find_hit"
        return [cached]

    def _released(self, req: Request) -> list[int]:
        return self.req_released.setdefault(req.request_id, [0] * len(self.windows))

    def _release_out_of_window(self, req: Request) -> None:
        """Release, in each windowed group, the blocks before the window of `req`'s next
        query (positions below num_computed_tokens - window + 1, read by no later query); with
        prefix caching only those already registered, whose K/V have landed."""
        computed, lists = req.num_computed_tokens, req.group_block_ids
        cap = len(lists[0])  # every group's list is as long
        if self.enable_prefix_caching:
            cap = min(cap, self.req_registered.get(req.request_id, 0))
        released = self.req_released.get(req.request_id)
        for g in self.windowed:
            limit = min(self._first_needed(g, computed), cap)
            start = released[g] if released else 0
            if limit <= start:
                continue
            ids = lists[g]
            for i in range(start, limit):
                bid = ids[i]
                if bid != self.null_block:
                    self._release(bid)
                    ids[i] = self.null_block
                    self.num_window_released += 1
            released = self._released(req)
            released[g] = limit
            req.block_version += 1

    def _release(self, bid: int) -> None:
        blk = self.blocks[bid]
        blk.ref_cnt -= 1
        assert blk.ref_cnt >= 0, f"block {bid} freed twice"
        if blk.ref_cnt == 0:
            self.free[bid] = blk

    def _shared_write_block(
        self, ids: list[int], computed: int, total_tokens: int
    ) -> tuple[int, Block] | None:
        """(index, block) of the block written next in `ids`, when other requests share it."""
        i = computed // self.block_size
        if computed >= total_tokens or i >= len(ids) or ids[i] == self.null_block:
            return None
        blk = self.blocks[ids[i]]
        return (i, blk) if blk.ref_cnt > 1 else None

    def fork(self, parent: Request, child: Request) -> None:
        """`child` shares every block of `parent` (which holds its computed prompt)."""
        assert not any(child.group_block_ids), "a forked request holds no blocks of its own"
        for ids in parent.group_block_ids:
            for bid in ids:
                if bid != self.null_block:
                    self.blocks[bid].ref_cnt += 1
        child.group_block_ids = [list(ids) for ids in parent.group_block_ids]
        child.block_version += 1
        if parent.request_id in self.req_released:
            self.req_released[child.request_id] = list(self.req_released[parent.request_id])

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.copies = self.copies, []
        return copies

    def free_request(self, req: Request) -> None:
        # Tail blocks first into the free list: they are the least likely to be shared,
        # so they are evicted before the prefix blocks other requests may want.
        for bids in reversed(list(zip(*req.group_block_ids))):  # a position in every group
            for bid in bids:
                if bid != self.null_block:
                    self._release(bid)
        req.group_block_ids = [[] for _ in self.windows]
        req.block_version += 1
        self.req_hashes.pop(req.request_id, None)
        self.req_registered.pop(req.request_id, None)
        self.req_released.pop(req.request_id, None)

    def trim(self, req: Request, num_tokens: int) -> None:
        """Give back the blocks past `req`'s first `num_tokens` tokens (speculative lookahead
        slots a step did not fill with accepted tokens; never registered, never shared)."""
        keep = self.blocks_needed(num_tokens)
        if len(req.block_ids) > keep:
            req.block_version += 1
        for ids in req.group_block_ids:
            for bid in reversed(ids[keep:]):
                blk = self.blocks[bid]
                blk.ref_cnt -= 1
                assert blk.ref_cnt == 0 and blk.hash is None, f"block {bid} trimmed while shared"
                self.free[bid] = blk
            del ids[keep:]

    def reset_prefix_cache(self) -> None:
        for blk in self.blocks:
            blk.hash = blk.token_ids = None
        self.cached.clear()

    def check_invariants(self, live: list[Request] = ()) -> None:
        """Every block free or owned, refcounts match owners (over every group), none
        negative; a request's groups hold lists of one length."""
        owners = [0] * self.num_blocks
        for req in live:
            assert len({len(ids) for ids in req.group_block_ids}) <= 1, f"{req}: group lengths"
            for ids in req.group_block_ids:
                for bid in ids:
                    owners[bid] += 1
        if self.null_block is not None:  # never owned, never free, never cached
            null = self.blocks[self.null_block]
            assert null.ref_cnt == 0 and null.hash is None and null.block_id not in self.free
            owners[self.null_block] = 0
        for blk in self.blocks:
            if blk.block_id == self.null_block:
                continue
            assert blk.ref_cnt >= 0, f"block {blk.block_id} has refcount {blk.ref_cnt}"
            assert blk.ref_cnt == owners[blk.block_id], (
                f"block {blk.block_id}: refcount {blk.ref_cnt}, owners {owners[blk.block_id]}"
            )
            assert (blk.ref_cnt == 0) == (blk.block_id in self.free), (
                f"block {blk.block_id}: refcount {blk.ref_cnt} but free={blk.block_id in self.free}"
            )
        for h, blk in self.cached.items():
            assert blk.hash == h
