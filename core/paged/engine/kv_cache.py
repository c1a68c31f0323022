"""The KV block pool: reference counts, a free list in LRU order, and prefix caching.

A full block is identified by a hash chain (parent hash, its token ids); a hit is
checked against the stored token ids, so a hash collision can never serve wrong K/V.
Freed blocks keep their hash until reused, so a later request with the same prefix
finds them again; eviction takes the least recently freed block first.

Sequences forked from one prompt (n > 1) share its blocks. A shared block is never written:
a sequence about to write into one (the prompt's partial last block) gets a fresh block and a
copy of it (`copies`, run on the device before the step's forward), copy on write.
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
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[int, Block] = {}  # hash -> block holding that full block
        self.req_hashes: dict[str, list[int]] = {}  # request id -> hashes of its full blocks
        self.req_registered: dict[str, int] = {}  # request id -> full blocks already cached
        self.copies: list[tuple[int, int]] = []  # (source, destination) for the next step
        self.queries = 0  # prefix-cache lookups (tokens) and hits (tokens), for metrics
        self.hits = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks if self.num_blocks else 0.0

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
                break
            hits.append(blk)
        return hits

    def cache_full_blocks(self, req: Request, upto: int | None = None) -> None:
        """Register the request's full blocks among its first `upto` computed tokens (default:
        all computed) in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        upto = req.num_computed_tokens if upto is None else upto
        full = upto // bs
        hashes = self._hash_blocks(req, upto)
        for i in range(self.req_registered.get(req.request_id, 0), full):
            h, blk = hashes[i], self.blocks[req.block_ids[i]]
            if blk.hash is not None:
                continue
            if h in self.cached:  # identical content already cached in another block
                continue
            blk.hash, blk.token_ids = h, tuple(req.token_ids[i * bs : (i + 1) * bs])
            self.cached[h] = blk
        self.req_registered[req.request_id] = full

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
        prefix blocks first. Returns False, changing nothing, when the pool is short."""
        cached = cached or []
        reusable_free = sum(1 for b in cached if b.ref_cnt == 0)
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
            if blk.ref_cnt == 0:
                del self.free[blk.block_id]
            blk.ref_cnt += 1
            req.block_ids.append(blk.block_id)
        for _ in range(max(need, 0)):
            req.block_ids.append(self._take_free().block_id)
        return True

    def _shared_write_block(self, req: Request, total_tokens: int) -> tuple[int, Block] | None:
        """(index, block) of the block `req` writes next, when other requests share it."""
        i = req.num_computed_tokens // self.block_size
        if req.num_computed_tokens >= total_tokens or i >= len(req.block_ids):
            return None
        blk = self.blocks[req.block_ids[i]]
        return (i, blk) if blk.ref_cnt > 1 else None

    def fork(self, parent: Request, child: Request) -> None:
        """`child` shares every block of `parent` (which holds its computed prompt)."""
        assert not child.block_ids, "a forked request holds no blocks of its own"
        for bid in parent.block_ids:
            self.blocks[bid].ref_cnt += 1
        child.block_ids = list(parent.block_ids)

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.copies = self.copies, []
        return copies

    def free_request(self, req: Request) -> None:
        # Tail blocks first into the free list: they are the least likely to be shared,
        # so they are evicted before the prefix blocks other requests may want.
        for bid in reversed(req.block_ids):
            blk = self.blocks[bid]
            blk.ref_cnt -= 1
            assert blk.ref_cnt >= 0, f"block {bid} freed twice"
            if blk.ref_cnt == 0:
                self.free[bid] = blk
        req.block_ids = []
        self.req_hashes.pop(req.request_id, None)
        self.req_registered.pop(req.request_id, None)

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
        for blk in self.blocks:
            assert blk.ref_cnt >= 0, f"block {blk.block_id} has refcount {blk.ref_cnt}"
            assert blk.ref_cnt == owners[blk.block_id], (
                f"block {blk.block_id}: refcount {blk.ref_cnt}, owners {owners[blk.block_id]}"
            )
            assert (blk.ref_cnt == 0) == (blk.block_id in self.free), (
                f"block {blk.block_id}: refcount {blk.ref_cnt} but free={blk.block_id in self.free}"
            )
        for h, blk in self.cached.items():
            assert blk.hash == h
