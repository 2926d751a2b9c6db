"""The host-memory tier: blocks evicted from the device pool are copied here instead of dropped.

    device pool ──evict (offload: copy)──▶ host slot ──(full: LRU out)──▶ disk tier, or dropped
        ▲                                      │
        └──── restore (copy back, a prefix hit of its own kind) ◀──────────┘

One buffer of num_slots block slots, allocated once: on CUDA in pinned host memory (the copies
are DMA, and a restore of a few blocks costs a fraction of recomputing them), on CPU a tensor of
its own beside the device pool (a separate byte store). A slot holds one block's K and V rows of
every layer, bit for bit as the pool held them (scales of an int8 or fp8 row included), so a
block that comes back is the block that left: restore is exact.

LRU: OrderedDict oldest first; match() marks a run recently used, so the restore that follows
cannot push it out when offloads make room. When full, the oldest block leaves for the disk tier
(engine/disk_tier.py) when there is one, else is dropped (BlockRemoved(HOST)).

One owner: the block pool calls every method, under the engine's lock; usage() reads len()s.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from pdserve.engine.block_pool import LowerTier, NoLowerTier, SpilledBlock, TierUsage
from pdserve.engine.config import CacheConfig, ModelConfig
from pdserve.engine.events import BlockRemoved, BlockStored, KVEvent, Tier, index_key
from pdserve.engine.hashing import BlockHash


@dataclass
class _Entry:
    slot: int
    block: SpilledBlock


class HostTier:
    """A bounded LRU of blocks in host memory, above an optional disk tier (a LowerTier)."""

    def __init__(self, kv_cache: torch.Tensor, num_slots: int, disk: DiskTierLike | None = None) -> None:
        if num_slots < 1:
            raise ValueError(f"host tier num_slots must be >= 1, got {num_slots}")
        self._kv = kv_cache  # [layer, K|V, block, offset, kv_head, row]
        layers, two, _, bs, heads, row = kv_cache.shape
        pin = kv_cache.device.type == "cuda"
        self._buf = torch.zeros(num_slots, layers, two, bs, heads, row, dtype=kv_cache.dtype, pin_memory=pin)
        self.num_slots = num_slots
        self.block_bytes = self._buf[0].numel() * self._buf.element_size()
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self._lru: OrderedDict[BlockHash, _Entry] = OrderedDict()
        self.disk = disk

    # --- LowerTier --------------------------------------------------------------------------
    def offload(self, block_id: int, block: SpilledBlock) -> list[KVEvent]:
        events = self._make_room()
        slot = self._free_slots.pop()
        self._buf[slot].copy_(self._kv[:, :, block_id])
        self._lru[block.block_hash] = _Entry(slot, block)
        events.append(BlockStored(block.block_hash, block.parent_hash, block.token_ids, slot, Tier.HOST))
        return events

    def match(self, block_hashes: Sequence[BlockHash]) -> int:
        n = 0
        for h in block_hashes:
            if h in self._lru:
                self._lru.move_to_end(h)
            elif self.disk is None or not self.disk.holds(h):
                break
            n += 1
        return n

    def restore(self, block_hash: BlockHash,
                block_id: int) -> tuple[SpilledBlock, Tier, list[KVEvent]] | None:
        entry = self._lru.pop(block_hash, None)
        if entry is None:
            if self.disk is None:
                return None
            return self.disk.restore(block_hash, self._kv, block_id)
        self._kv[:, :, block_id].copy_(self._buf[entry.slot])
        self._free_slots.append(entry.slot)
        return entry.block, Tier.HOST, [BlockRemoved(block_hash, entry.slot, Tier.HOST)]

    def keys(self) -> list[BlockHash]:
        host = [index_key(h, Tier.HOST) for h in self._lru]
        return host + (self.disk.keys() if self.disk is not None else [])

    def usage(self) -> list[TierUsage]:
        host = TierUsage(Tier.HOST, self.num_slots, len(self._lru))
        return [host] + ([self.disk.usage()] if self.disk is not None else [])

    def clear(self) -> list[KVEvent]:
        events: list[KVEvent] = [BlockRemoved(h, e.slot, Tier.HOST) for h, e in self._lru.items()]
        self._free_slots.extend(e.slot for e in self._lru.values())
        self._lru.clear()
        return events

    # --- internals ------------------------------------------------------------------------------
    def _make_room(self) -> list[KVEvent]:
        if self._free_slots:
            return []
        block_hash, entry = self._lru.popitem(last=False)
        self._free_slots.append(entry.slot)
        events: list[KVEvent] = [BlockRemoved(block_hash, entry.slot, Tier.HOST)]
        if self.disk is not None:
            events += self.disk.write(entry.block, self._buf[entry.slot])
        return events


class DiskTierLike(Protocol):
    """What the host tier needs of the disk tier below it (engine/disk_tier.py's DiskTier)."""

    def holds(self, block_hash: BlockHash) -> bool: ...

    def write(self, block: SpilledBlock, kv: torch.Tensor) -> list[KVEvent]: ...

    def restore(self, block_hash: BlockHash, kv_cache: torch.Tensor,
                block_id: int) -> tuple[SpilledBlock, Tier, list[KVEvent]] | None: ...

    def keys(self) -> list[BlockHash]: ...

    def usage(self) -> TierUsage: ...


def build_lower_tier(kv_cache: torch.Tensor, cache: CacheConfig, model: ModelConfig,
                     salt: bytes) -> LowerTier:
    """The tiers below the device pool that `cache` asks for: none, host, or host over disk."""
    slots = cache.resolve_host_blocks(model)
    if not slots:
        return NoLowerTier()
    disk = None
    if cache.disk_cache_dir is not None:
        from pdserve.engine.disk_tier import DiskTier  # noqa: PLC0415 (only with --disk-cache-dir)
        disk = DiskTier(cache.disk_cache_dir, cache.resolve_disk_blocks(model), kv_cache, salt)
    return HostTier(kv_cache, slots, disk)
