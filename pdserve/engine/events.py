"""KV cache events: what the block pool records and a publisher ships.

The pool appends BlockStored when a full block gets its chained hash and
BlockRemoved when a cached block is evicted. After each engine step the
engine drains them to a publisher: NullPublisher here, a Redis publisher in
the cluster (the router's prefix index reads them), a recording one in tests
(tests/conftest.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pdserve.engine.hashing import BlockHash


@dataclass(frozen=True)
class BlockStored:
    block_hash: BlockHash
    parent_hash: BlockHash | None  # None: the first block of a prompt
    token_ids: tuple[int, ...]
    block_id: int


@dataclass(frozen=True)
class BlockRemoved:
    block_hash: BlockHash
    block_id: int


KVEvent = BlockStored | BlockRemoved


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

