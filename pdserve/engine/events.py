"""KV cache events: what the block pool records and a publisher ships.

The pool appends BlockStored when a full block gets its chained hash and
BlockRemoved when a cached block is evicted. Each event names the tier it happened in: a block
evicted from the device pool into the host tier is BlockRemoved(DEVICE), then BlockStored(HOST);
one that leaves the host tier for disk is BlockRemoved(HOST) then BlockStored(DISK); one loaded
back is BlockRemoved(HOST or DISK) then BlockStored(DEVICE). A worker holds a block in one tier
at a time (the tiers are exclusive), so the index can credit each tier's hits at its own weight.

After each engine step the engine drains them to a publisher: NullPublisher here, a Redis publisher in
the cluster (the router's prefix index reads them), a recording one in tests
(tests/conftest.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

from pdserve.engine.hashing import BlockHash, tier_key


class Tier(enum.Enum):
    """Where a worker holds a block: the device pool the model reads, or a tier below it."""

    DEVICE = "device"  # the primary pool (GPU memory, or the CPU pool on a CPU worker)
    HOST = "host"  # host memory: a pinned buffer on CUDA, a separate byte store on CPU
    DISK = "disk"  # files under --disk-cache-dir; survives a restart


@dataclass(frozen=True)
class BlockStored:
    block_hash: BlockHash
    parent_hash: BlockHash | None  # None: the first block of a prompt
    token_ids: tuple[int, ...]
    block_id: int  # the block's id in its tier (a pool block, a host slot; 0 on disk)
    tier: Tier = Tier.DEVICE


@dataclass(frozen=True)
class BlockRemoved:
    block_hash: BlockHash
    block_id: int
    tier: Tier = Tier.DEVICE


KVEvent = BlockStored | BlockRemoved


def index_key(block_hash: BlockHash, tier: Tier) -> BlockHash:
    """The hash a block held in `tier` is published under (hashing.tier_key)."""
    return block_hash if tier is Tier.DEVICE else tier_key(block_hash, tier.value)


class KVEventPublisher(Protocol):
    def publish(self, events: list[KVEvent]) -> None: ...

    def resync(self) -> None:
        """Republish every block the pool caches (the index lost or doubts this worker's entries)."""
        ...


class NullPublisher:
    """Drops events: a single engine with no index to feed."""

    def publish(self, events: list[KVEvent]) -> None:
        return None

    def resync(self) -> None:
        return None

