"""The index's change feed, as a reader sees it: events, positions, leases, and the followed table.

Pure: no I/O. pdserve/index/mirror.py reads Redis and hands what it read to these types; the
feed's wire format (one stream entry per APPLY_LUA or DROP_LUA call) is described in
pdserve/index/redis_layout.py next to PUBLISH_FEED_LUA.

A FollowedIndex lives from one snapshot to the next:

    from_snapshot(position, entries)       the index as read after `position` (seq S, stream id P)
    follow(events after P) ...             each event must carry seq = last + 1; the first that
                                           does not is returned as the gap, and nothing after it is
                                           applied (the reader takes a new snapshot)
    needs_snapshot(store's position)       between events: has the store's counter moved in a way
                                           no event we can still read explains? (bumped, reset,
                                           reseeded after Redis lost it, the stream rolled back)

NOTE: the snapshot is not one atomic read (that would stall Redis on a big index). The position
is read first, then the sets; every event after the position is replayed on top. Replaying an
event the sets already reflect is harmless: apply and drop only add and discard, so each
(entry, hash) pair ends as the last event touching it says, and pairs no later event touches
are as the sets were read after the position.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from pdserve.engine.hashing import HASH_BYTES, BlockHash
from pdserve.index.base import WorkerKey, parse_entry_member
from pdserve.index.memory import BlockHolders

FEED_VERSION = b"1"  # the `v` field of every stream entry this reader understands
StreamId = tuple[int, int]  # '<ms>-<n>' of a Redis stream entry, as numbers that compare in order
STREAM_START: StreamId = (0, 0)


class MalformedEvent(ValueError):
    """A feed entry this reader cannot apply (another version, junk): the reader takes a snapshot."""


@dataclass(frozen=True)
class FeedPosition:
    stream_id: StreamId  # the last stream entry read (STREAM_START: none yet)
    seq: int  # the feed counter's value after that entry


@dataclass(frozen=True)
class FeedEvent:
    stream_id: StreamId
    seq: int
    entry: WorkerKey
    stored: tuple[BlockHash, ...]
    removed: tuple[BlockHash, ...]


def parse_stream_id(raw: bytes | str) -> StreamId:
    text = raw.decode() if isinstance(raw, bytes) else raw
    ms, _, n = text.partition("-")
    return int(ms), int(n or 0)


def format_stream_id(stream_id: StreamId) -> str:
    return f"{stream_id[0]}-{stream_id[1]}"


def split_hashes(blob: bytes) -> tuple[BlockHash, ...]:
    if len(blob) % HASH_BYTES:
        raise MalformedEvent(f"a feed entry carries {len(blob)} bytes of hashes, not a multiple of "
                             f"{HASH_BYTES}")
    return tuple(BlockHash(blob[i:i + HASH_BYTES]) for i in range(0, len(blob), HASH_BYTES))


def decode_event(stream_id: bytes, fields: Mapping[bytes, bytes]) -> FeedEvent:
    """One stream entry; MalformedEvent when it is not one this reader understands."""
    if fields.get(b"v") != FEED_VERSION:
        raise MalformedEvent(f"feed entry {stream_id!r} has version {fields.get(b'v')!r}; this reader "
                             f"understands {FEED_VERSION!r} (is another pdserve version writing?)")
    try:
        return FeedEvent(parse_stream_id(stream_id), int(fields[b"seq"]),
                         parse_entry_member(fields[b"entry"]), split_hashes(fields[b"stored"]),
                         split_hashes(fields[b"removed"]))
    except (KeyError, ValueError) as bad:  # MalformedEvent and UnicodeDecodeError are ValueErrors
        raise MalformedEvent(f"feed entry {stream_id!r} cannot be read: {bad!r}") from bad


@dataclass(frozen=True)
class LeaseView:
    """The leases as read at `read_at`: worker_id -> (epoch, when the lease runs out at the latest).

    NOTE: a lease is trusted until read_at + its remaining TTL, never longer: while Redis does not
    answer, the reader keeps its last view, and a worker stops counting when its lease would have
    run out had nobody renewed it. A lease without a TTL counts until the next read.
    """

    leases: Mapping[str, tuple[int, float]] = field(default_factory=dict)
    read_at: float = float("-inf")

    def is_current(self, entry: WorkerKey, now: float) -> bool:
        lease = self.leases.get(entry.worker_id)
        return lease is not None and lease[0] == entry.epoch and lease[1] > now

    def live(self, now: float) -> dict[str, int]:
        return {w: epoch for w, (epoch, until) in self.leases.items() if until > now}


def needs_snapshot(mine: FeedPosition, store: FeedPosition) -> bool:
    """Whether the store's counter and newest stream entry (read together, between events) show
    a change that no event after `mine` can explain."""
    if store.seq < mine.seq:
        return True  # the counter went back: Redis lost data, or was restored from an older copy
    return store.seq != mine.seq and store.stream_id <= mine.stream_id  # moved, with no entry to say how


class FollowedIndex:
    """The index's entries as of a feed position; the feed's events move it forward."""

    def __init__(self, position: FeedPosition, table: BlockHolders) -> None:
        self._position = position
        self._table = table

    @classmethod
    def from_snapshot(cls, position: FeedPosition,
                      entries: Mapping[WorkerKey, Iterable[BlockHash]]) -> FollowedIndex:
        table = BlockHolders()
        for entry, hashes in entries.items():
            table.apply(entry, hashes, ())
        return cls(position, table)

    @property
    def position(self) -> FeedPosition:
        return self._position

    def follow(self, events: Sequence[FeedEvent]) -> FeedEvent | None:
        """Apply events in order; the first one that does not carry seq = last + 1 (not applied,
        nor anything after it), or None when all followed."""
        for event in events:
            if event.seq != self._position.seq + 1:
                return event
            self._table.apply(event.entry, event.stored, event.removed)
            self._position = FeedPosition(event.stream_id, event.seq)
        return None

    def match(self, block_hashes: Sequence[BlockHash], leases: LeaseView, now: float) -> dict[str, int]:
        return self._table.match(block_hashes, lambda entry: leases.is_current(entry, now))

    def worker_hashes(self, worker_id: str) -> set[BlockHash]:
        return self._table.worker_hashes(worker_id)
