"""IndexPublisher: ships a worker's KV cache events to a PrefixIndex, one apply() per engine step.

The engine's block pool records BlockStored / BlockRemoved in order; within one batch a
hash may be stored and later evicted (or evicted and stored again). Only the last event
of each hash matters, so a batch is folded to two disjoint sets before apply().

When the index store does not answer, the engine must keep serving: publish() drops the
batch, logs once per outage, and marks the publisher out of sync. The index may then
claim blocks the worker has evicted (costing a recompute, never a wrong answer) until
the worker calls resync() with its cached hashes, as it also should when its lease
comes back Lease.STARTED (the store may have lost everything).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from pdserve.engine.events import BlockRemoved, BlockStored, KVEvent
from pdserve.index.base import PrefixIndex, StoreUnavailable, WorkerKey

log = logging.getLogger(__name__)


def fold_events(events: Iterable[KVEvent]) -> tuple[list[bytes], list[bytes]]:
    """(stored, removed): the hashes whose last event was a store, and those whose last was a removal."""
    last: dict[bytes, bool] = {}
    for event in events:
        if isinstance(event, BlockStored):
            last[event.block_hash] = True
        elif isinstance(event, BlockRemoved):
            last[event.block_hash] = False
        else:
            raise TypeError(f"unknown KV event {event!r}; expected BlockStored or BlockRemoved")
    stored = [h for h, present in last.items() if present]
    removed = [h for h, present in last.items() if not present]
    return stored, removed


class IndexPublisher:
    """A KVEventPublisher for one worker incarnation."""

    def __init__(self, index: PrefixIndex, worker: WorkerKey) -> None:
        self.index = index
        self.worker = worker
        self.in_sync = True
        self.dropped_events = 0

    def publish(self, events: list[KVEvent]) -> None:
        if not events:
            return
        stored, removed = fold_events(events)
        try:
            self.index.apply(self.worker, stored, removed)
        except StoreUnavailable as e:
            if self.in_sync:
                log.warning("prefix index unavailable; dropping KV events of %s until resync: %s",
                            self.worker.worker_id, e)
            self.in_sync = False
            self.dropped_events += len(events)

    def resync(self, cached_hashes: Iterable[bytes]) -> bool:
        """Make the index hold exactly cached_hashes for this worker; True when it did."""
        try:
            self.index.replace(self.worker, cached_hashes)
        except StoreUnavailable as e:
            log.warning("prefix index resync of %s failed, will retry: %s", self.worker.worker_id, e)
            return False
        self.in_sync = True
        return True
