"""KV cache events: what the block pool records and a publisher ships.

The pool appends BlockStored when a full block gets its chained hash and
BlockRemoved when a cached block is evicted. After each engine step the
engine drains them to a publisher: NullPublisher here and in tests, a Redis
publisher in the cluster (the router's prefix index reads them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class BlockStored:
    block_hash: bytes
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    block_id: int


@dataclass(frozen=True)
class BlockRemoved:
    block_hash: bytes
    block_id: int


KVEvent = BlockStored | BlockRemoved


class KVEventPublisher(Protocol):
    def publish(self, events: list[KVEvent]) -> None: ...


class NullPublisher:
    """Drops events: a single engine with no index to feed."""

    def publish(self, events: list[KVEvent]) -> None:
        return None


class RecordingPublisher:
    """Keeps every event, in order, for tests."""

    def __init__(self) -> None:
        self.events: list[KVEvent] = []

    def publish(self, events: list[KVEvent]) -> None:
        self.events.extend(events)
