"""Block accounting for the paged KV cache, with automatic prefix caching.

Every block is in exactly one of three states:

    FREE       ref 0, no hash          -> handed out first by allocate()
    CACHED     ref 0, hashed           -> reusable by a prefix match; evicted LRU
    IN USE     ref > 0                 -> held by one or more sequences

    allocate:  FREE/CACHED(evict, LRU first) -> IN USE
    acquire:   CACHED -> IN USE, or IN USE ref+1 (a prefix hit)
    release:   ref-1; at 0 -> CACHED if hashed, else FREE
    commit:    give an IN USE full block its chained hash (BlockStored); commit_blocks
               does it for a run of one token sequence's full blocks (the scheduler after
               a step, the KV hand-off when a transferred prompt is parked)
    evict:     CACHED -> FREE, hash dropped (BlockRemoved); with a lower tier (host memory,
               then disk) the block's KV is copied down first (offload), so it is not lost
    acquire_prefix: the longest cached prefix of a prompt, device blocks acquired, then the
               blocks after them that a lower tier holds loaded back into fresh blocks
               (restore: a copy, not a recompute) and committed again
    discard:   a block the KV audit found wrong (BlockRemoved): CACHED -> FREE at
               once; IN USE loses its hash, so nothing new matches it, and goes
               FREE (not CACHED) when its last reference is released

NOTE: only full blocks are ever hashed (see hashing.py), so partial blocks are
never shared; a sequence writes into its partial tail block alone.

Every hashed block keeps its own token ids and its parent's hash, so the
whole token prefix of a cached block can be rebuilt by walking the chain
(prefix_chain); the KV audit (engine/audit.py) recomputes from it. A block
whose ancestor was evicted has no chain: it can never be matched either
(match_prefix walks from the first block), and LRU eviction reclaims it.

The lower tier is a seam (LowerTier): NoLowerTier when none is configured, HostTier
(engine/host_tier.py, which owns the KV bytes it holds and its own disk tier) otherwise. The
tiers are exclusive: a hash lives in the device pool or below it, never in both, and every move
is an event of the tier it left and one of the tier it entered.

The pool records BlockStored / BlockRemoved events; a publisher drains them
(engine/events.py). Pure Python: no torch, no I/O.
"""

from __future__ import annotations

import enum
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pdserve.engine.events import BlockRemoved, BlockStored, KVEvent, Tier
from pdserve.engine.hashing import BlockHash


class NoFreeBlocksError(RuntimeError):
    """The pool cannot hand out the requested number of blocks right now."""


class Discarded(enum.Enum):
    """What discard() did with a block."""

    EVICTED = "evicted"  # it was cached and unreferenced: FREE now
    UNLISTED = "unlisted"  # it is in use: its hash is gone, it goes FREE when released
    GONE = "gone"  # it no longer held that hash (evicted meanwhile): nothing to do


@dataclass(frozen=True)
class SpilledBlock:
    """What a lower tier keeps of a block besides its KV bytes: enough to commit it again."""

    block_hash: BlockHash
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class TierUsage:
    """One tier's capacity and use, in blocks."""

    tier: Tier
    capacity_blocks: int
    used_blocks: int


@dataclass
class PrefixHit:
    """acquire_prefix's result: block_ids (acquired), of which `restored` came back from a lower tier."""

    block_ids: list[int] = field(default_factory=list)
    restored: dict[Tier, int] = field(default_factory=dict)  # blocks loaded back, per tier


class LowerTier(Protocol):
    """Where evicted blocks go instead of being dropped. Each method returns the events of what it
    did, which the pool records in order with its own."""

    def offload(self, block_id: int, block: SpilledBlock) -> list[KVEvent]:
        """Keep a copy of device block block_id's KV (about to be reused) under block.block_hash."""
        ...

    def match(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many leading block_hashes this tier holds; marks them recently used."""
        ...

    def restore(self, block_hash: BlockHash,
                block_id: int) -> tuple[SpilledBlock, Tier, list[KVEvent]] | None:
        """Copy the KV held under block_hash into device block block_id and forget it here; None
        when it is no longer held (or its copy failed a check: then it is dropped)."""
        ...

    def keys(self) -> list[BlockHash]:
        """The index keys of every block held here (events.index_key of each, per its tier)."""
        ...

    def usage(self) -> list[TierUsage]:
        ...

    def clear(self) -> list[KVEvent]:
        """Forget every block held in memory (a disk tier keeps its files)."""
        ...


class NoLowerTier:
    """No tier below the device pool: an evicted block is gone."""

    def offload(self, block_id: int, block: SpilledBlock) -> list[KVEvent]:
        return []

    def match(self, block_hashes: Sequence[BlockHash]) -> int:
        return 0

    def restore(self, block_hash: BlockHash,
                block_id: int) -> tuple[SpilledBlock, Tier, list[KVEvent]] | None:
        return None

    def keys(self) -> list[BlockHash]:
        return []

    def usage(self) -> list[TierUsage]:
        return []

    def clear(self) -> list[KVEvent]:
        return []


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, lower: LowerTier | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.lower: LowerTier = lower or NoLowerTier()
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref_counts = [0] * num_blocks
        self._block_hash: list[BlockHash | None] = [None] * num_blocks
        self._block_tokens: list[tuple[int, ...]] = [()] * num_blocks  # of a hashed block only
        self._parent_hash: list[BlockHash | None] = [None] * num_blocks  # None: first block of a prompt
        self._free: deque[int] = deque(range(num_blocks))
        self._cached_lru: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._hash_to_block: dict[BlockHash, int] = {}
        self._events: deque[KVEvent] = deque()

    # --- queries -------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks allocate() can hand out now (free plus evictable cached)."""
        return len(self._free) + len(self._cached_lru)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash_to_block)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def block_hash(self, block_id: int) -> BlockHash | None:
        return self._block_hash[block_id]

    def match_prefix(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """Block ids of the longest run of block_hashes cached here, from the start.

        Takes no references: call acquire() on the result to use it.
        """
        matched: list[int] = []
        for h in block_hashes:
            block_id = self._hash_to_block.get(h)
            if block_id is None:
                break
            matched.append(block_id)
        return matched

    def block_tokens(self, block_id: int) -> tuple[int, ...]:
        """The token ids of a hashed block (empty for an unhashed one)."""
        return self._block_tokens[block_id]

    def cached_block_ids(self) -> list[int]:
        """Every hashed block, referenced or not: what a prefix match can return."""
        return list(self._hash_to_block.values())

    def prefix_chain(self, block_id: int) -> list[int] | None:
        """Block ids from the first block of block_id's prefix down to block_id itself.

        None when block_id holds no hash, or when an ancestor is no longer cached (the
        block cannot be matched then, and its prefix tokens are gone).
        """
        chain: list[int] = []
        current: int | None = block_id
        while current is not None:
            if self._block_hash[current] is None:
                return None
            chain.append(current)
            parent = self._parent_hash[current]
            if parent is None:
                break
            current = self._hash_to_block.get(parent)
            if current is None or len(chain) >= self.num_blocks:  # evicted; or a cycle, never a chain
                return None
        chain.reverse()
        return chain

    def cached_hashes(self) -> list[BlockHash]:
        """Every index key this worker can serve now, device blocks and lower tiers' (a resync of
        an index that lost events)."""
        return list(self._hash_to_block) + self.lower.keys()

    def tier_usage(self) -> list[TierUsage]:
        """Capacity and use of the device pool and of each tier below it."""
        return [TierUsage(Tier.DEVICE, self.num_blocks, self.num_used_blocks), *self.lower.usage()]

    def leaked_blocks(self) -> list[int]:
        """Blocks still referenced; empty when every sequence has let go."""
        return [b for b, ref in enumerate(self._ref_counts) if ref]

    # --- transitions ---------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """n fresh private blocks (ref 1), evicting least-recently-used cached blocks if needed."""
        if n > self.num_free_blocks:
            raise NoFreeBlocksError(f"need {n} KV blocks, {self.num_free_blocks} free")
        blocks = [self._take_one() for _ in range(n)]
        for b in blocks:
            self._ref_counts[b] = 1
        return blocks

    def acquire(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each block (a prefix hit)."""
        for b in block_ids:
            if self._ref_counts[b] == 0:
                del self._cached_lru[b]
            self._ref_counts[b] += 1

    def acquire_prefix(self, block_hashes: Sequence[BlockHash]) -> PrefixHit:
        """Acquire the longest prefix of block_hashes held here: device blocks first, then the run
        after them a lower tier holds, each loaded back into a fresh block (restore) and committed.

        NOTE: restoring takes blocks from the free list first, then by evicting LRU cached blocks
        (which go down a tier in turn); it stops early when the pool has no block to give or the
        lower tier lost the block meanwhile. The caller releases the result like any prefix hit.
        """
        hit = PrefixHit(self.match_prefix(block_hashes))
        self.acquire(hit.block_ids)
        rest = block_hashes[len(hit.block_ids):]
        for j in range(self.lower.match(rest)):
            if not self.num_free_blocks:
                break
            block_id = self._take_one()
            restored = self.lower.restore(rest[j], block_id)
            if restored is None:
                self._free.appendleft(block_id)
                break
            block, tier, events = restored
            self._events.extend(events)
            self._ref_counts[block_id] = 1
            self.commit(block_id, block.block_hash, block.parent_hash, block.token_ids)
            hit.block_ids.append(block_id)
            hit.restored[tier] = hit.restored.get(tier, 0) + 1
        return hit

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block.

        NOTE: released tail-first, so a sequence's deepest blocks become the
        least recently used and are evicted before the prefix others share.
        """
        for b in reversed(block_ids):
            ref = self._ref_counts[b]
            if ref <= 0:
                raise RuntimeError(f"block {b} released more often than acquired")
            self._ref_counts[b] = ref - 1
            if ref == 1:
                if self._block_hash[b] is None:
                    self._free.append(b)
                else:
                    self._cached_lru[b] = None

    def commit(self, block_id: int, block_hash: BlockHash, parent_hash: BlockHash | None,
               token_ids: Sequence[int]) -> bool:
        """Register a full, computed block under its chained hash.

        Returns False (and leaves the block private) when another block already
        holds that hash: two sequences computed the same prefix at once.
        """
        if self._ref_counts[block_id] == 0:
            raise RuntimeError(f"block {block_id} committed while not in use")
        if self._block_hash[block_id] is not None:
            return self._block_hash[block_id] == block_hash
        if block_hash in self._hash_to_block:
            return False
        tokens = tuple(token_ids)
        self._block_hash[block_id] = block_hash
        self._block_tokens[block_id] = tokens
        self._parent_hash[block_id] = parent_hash
        self._hash_to_block[block_hash] = block_id
        self._events.append(BlockStored(block_hash, parent_hash, tokens, block_id))
        return True

    def commit_blocks(self, block_ids: Sequence[int], hashes: Sequence[BlockHash], token_ids: Sequence[int],
                      start: int = 0) -> None:
        """Commit full blocks start..len(hashes)-1 of one token sequence: block j holds
        token_ids[j*bs:(j+1)*bs] in block_ids[j] under hashes[j], chained to hashes[j-1] (no
        parent for block 0). hashes come from hash_blocks over the same tokens and salt."""
        bs = self.block_size
        for j in range(start, len(hashes)):
            parent = hashes[j - 1] if j else None
            self.commit(block_ids[j], hashes[j], parent, token_ids[j * bs:(j + 1) * bs])

    def discard(self, block_id: int, block_hash: BlockHash) -> Discarded:
        """Take a block whose KV is wrong out of the prefix cache (BlockRemoved).

        NOTE: a block in use cannot be freed under its holders; it loses its hash instead,
        so no new request matches it, and release() then frees it instead of caching it.
        """
        if self._block_hash[block_id] != block_hash:
            return Discarded.GONE
        self._forget_hash(block_id)
        if self._ref_counts[block_id]:
            return Discarded.UNLISTED
        del self._cached_lru[block_id]
        self._free.append(block_id)
        return Discarded.EVICTED

    def reset_cache(self) -> int:
        """Drop every cached, unreferenced block, and what the lower tiers hold in memory (not
        offloaded: a reset is for a cold start); returns how many device blocks."""
        n = len(self._cached_lru)
        while self._cached_lru:
            self._free.append(self._evict_lru(offload=False))
        self._events.extend(self.lower.clear())
        return n

    def drain_events(self) -> list[KVEvent]:
        events = list(self._events)
        self._events.clear()
        return events

    # --- internals -----------------------------------------------------
    def _take_one(self) -> int:
        if self._free:
            return self._free.popleft()
        return self._evict_lru()

    def _evict_lru(self, offload: bool = True) -> int:
        block_id, _ = self._cached_lru.popitem(last=False)
        spilled = SpilledBlock(self._block_hash[block_id], self._parent_hash[block_id],
                               self._block_tokens[block_id])
        self._forget_hash(block_id)
        if offload:
            self._events.extend(self.lower.offload(block_id, spilled))  # after its device removal
        return block_id

    def _forget_hash(self, block_id: int) -> None:
        block_hash = self._block_hash[block_id]
        assert block_hash is not None
        del self._hash_to_block[block_hash]
        self._block_hash[block_id] = None
        self._block_tokens[block_id] = ()
        self._parent_hash[block_id] = None
        self._events.append(BlockRemoved(block_hash, block_id))
