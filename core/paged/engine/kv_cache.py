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
"""

from __future__ import annotations

from collections import OrderedDict

from paged.engine.request import Request


class Block:
    __slots__ = ("block_id", "ref_cnt", "hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None  # for collision checks


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        window: int | None = None,
    ):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[int, Block] = {}  # hash -> block holding that full block
        self.req_hashes: dict[str, list[int]] = {}  # request id -> hashes of its full blocks
        self.req_registered: dict[str, int] = {}  # request id -> full blocks already cached
        self.copies: list[tuple[int, int]] = []  # (source, destination) for the next step
        # Sliding window: block 0 is the null block, the placeholder for released positions.
        self.window = window
        self.null_block: int | None = None
        if window is not None:
            self.null_block = 0
            del self.free[0]
        self.req_released: dict[str, int] = {}  # request id -> leading positions released
        self.reset_counters()

    def reset_counters(self) -> None:
        """The counters /metrics reports, as at start (also after the start-up warm-up)."""
        self.queries = 0  # prefix-cache lookups (tokens) and hits (tokens), for metrics
        self.hits = 0
        self.num_window_released = 0  # blocks released out of a window (counter)
        self.peak_seq_blocks = 0  # most blocks one sequence held at once

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

    def find_cached(self, req: Request) -> list[Block]:
        """Cached blocks of the longest cached prefix; leaves at least one token to compute."""
        pooling = req.params.pooling
        if not self.enable_prefix_caching or req.params.prompt_logprobs is not None:
            return []  # prompt_logprobs need the logits of every prompt token
        if pooling is not None and pooling.needs_every_token:
            return []  # MEAN / CLS pooling: the hidden states of every prompt token
        hashes = self._hash_blocks(req, req.num_tokens - 1)
        bs, hits = self.block_size, []
        for i, h in enumerate(hashes):
            blk = self.cached.get(h)
            if blk is None or blk.token_ids != tuple(req.token_ids[i * bs : (i + 1) * bs]):
                if self.window is None:
                    break
                blk = None
            hits.append(blk)
        if self.window is None:
            return hits
        return self._window_hit(hits)

    def _window_hit(self, found: list[Block | None]) -> list[Block | None]:
        """The longest prefix whose first computed token finds every block of its window
        cached (the chain hash makes each hit imply the whole prefix before it): None for
        the positions before the window, the cached blocks from there on."""
        best, run = 0, 0
        for i, blk in enumerate(found):
            run = run + 1 if blk is not None else 0
            if run >= i + 1 - self._first_needed((i + 1) * self.block_size):
                best = i + 1
        first = self._first_needed(best * self.block_size)
        return [None] * first + found[first:best]

    def _first_needed(self, pos: int) -> int:
        """The first block a query at position `pos` (or later) can read in the window."""
        return max(pos - self.window + 1, 0) // self.block_size

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
            if req.block_ids[i] == self.null_block:  # released: it was registered before
                continue
            h, blk = hashes[i], self.blocks[req.block_ids[i]]
            if blk.hash is not None:
                continue
            if h in self.cached:  # identical content already cached in another block
                continue
            blk.hash, blk.token_ids = h, tuple(req.token_ids[i * bs : (i + 1) * bs])
            self.cached[h] = blk
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

    def allocate(self, req: Request, total_tokens: int, cached: list[Block] | None = None) -> bool:
        """Make `req` hold blocks for its first `total_tokens` tokens, taking the `cached`
        prefix blocks first (None: a position before the window, the null block). Returns
        False, changing nothing but the release of blocks out of the window, when the pool
        is short."""
        self._release_out_of_window(req)
        cached = cached or []
        reusable_free = sum(1 for b in cached if b is not None and b.ref_cnt == 0)
        have = len(req.block_ids) + len(cached)
        need = self.blocks_needed(total_tokens) - have
        shared = self._shared_write_block(req, total_tokens)
        if max(need, 0) + reusable_free + (shared is not None) > len(self.free):
            return False
        if shared is not None:  # copy on write
            i, blk = shared
            new = self._take_free()
            blk.ref_cnt -= 1  # still held by the others: more than one held it
            req.block_ids[i] = new.block_id
            self.copies.append((blk.block_id, new.block_id))
        for blk in cached:
            if blk is None:
                req.block_ids.append(self.null_block)
                continue
            if blk.ref_cnt == 0:
                del self.free[blk.block_id]
            blk.ref_cnt += 1
            req.block_ids.append(blk.block_id)
        if cached and cached[0] is None:  # a hit past the window: its leading positions
            lead = next((i for i, b in enumerate(cached) if b is not None), len(cached))
            self.req_released[req.request_id] = lead
        for _ in range(max(need, 0)):
            req.block_ids.append(self._take_free().block_id)
        if self.window is not None:
            held = len(req.block_ids) - self.req_released.get(req.request_id, 0)
            self.peak_seq_blocks = max(self.peak_seq_blocks, held)
        return True

    def _release_out_of_window(self, req: Request) -> None:
        """Release the blocks before the window of `req`'s next query (positions below
        num_computed_tokens - window + 1, read by no later query); with prefix caching only
        those already registered, whose K/V have landed."""
        if self.window is None:
            return
        limit = min(self._first_needed(req.num_computed_tokens), len(req.block_ids))
        if self.enable_prefix_caching:
            limit = min(limit, self.req_registered.get(req.request_id, 0))
        start = self.req_released.get(req.request_id, 0)
        for i in range(start, limit):
            bid = req.block_ids[i]
            if bid != self.null_block:
                self._release(bid)
                req.block_ids[i] = self.null_block
                self.num_window_released += 1
        if limit > start:
            self.req_released[req.request_id] = limit

    def _release(self, bid: int) -> None:
        blk = self.blocks[bid]
        blk.ref_cnt -= 1
        assert blk.ref_cnt >= 0, f"block {bid} freed twice"
        if blk.ref_cnt == 0:
            self.free[bid] = blk

    def _shared_write_block(self, req: Request, total_tokens: int) -> tuple[int, Block] | None:
        """(index, block) of the block `req` writes next, when other requests share it."""
        i = req.num_computed_tokens // self.block_size
        if req.num_computed_tokens >= total_tokens or i >= len(req.block_ids):
            return None
        if req.block_ids[i] == self.null_block:
            return None
        blk = self.blocks[req.block_ids[i]]
        return (i, blk) if blk.ref_cnt > 1 else None

    def fork(self, parent: Request, child: Request) -> None:
        """`child` shares every block of `parent` (which holds its computed prompt)."""
        assert not child.block_ids, "a forked request holds no blocks of its own"
        for bid in parent.block_ids:
            if bid != self.null_block:
                self.blocks[bid].ref_cnt += 1
        child.block_ids = list(parent.block_ids)
        if parent.request_id in self.req_released:
            self.req_released[child.request_id] = self.req_released[parent.request_id]

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.copies = self.copies, []
        return copies

    def free_request(self, req: Request) -> None:
        # Tail blocks first into the free list: they are the least likely to be shared,
        # so they are evicted before the prefix blocks other requests may want.
        for bid in reversed(req.block_ids):
            if bid != self.null_block:
                self._release(bid)
        req.block_ids = []
        self.req_hashes.pop(req.request_id, None)
        self.req_registered.pop(req.request_id, None)
        self.req_released.pop(req.request_id, None)

    def trim(self, req: Request, num_tokens: int) -> None:
        """Give back the blocks past `req`'s first `num_tokens` tokens (speculative lookahead
        slots a step did not fill with accepted tokens; never registered, never shared)."""
        keep = self.blocks_needed(num_tokens)
        for bid in reversed(req.block_ids[keep:]):
            blk = self.blocks[bid]
            blk.ref_cnt -= 1
            assert blk.ref_cnt == 0 and blk.hash is None, f"block {bid} trimmed while shared"
            self.free[bid] = blk
        del req.block_ids[keep:]

    def reset_prefix_cache(self) -> None:
        for blk in self.blocks:
            blk.hash = blk.token_ids = None
        self.cached.clear()

    def check_invariants(self, live: list[Request] = ()) -> None:
        """Every block free or owned, refcounts match owners, none negative."""
        owners = [0] * self.num_blocks
        for req in live:
            for bid in req.block_ids:
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
