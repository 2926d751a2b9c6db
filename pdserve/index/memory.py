"""InMemoryPrefixIndex: the reference implementation of the contract, for tests and one process.

Pure: no I/O. Time comes from the `clock` it is given, so tests expire leases by
moving a fake clock instead of sleeping.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from pdserve.engine.hashing import BlockHash
from pdserve.index.base import Lease, WorkerKey, check_ttl


@dataclass(frozen=True)
class _Lease:
    epoch: int
    expires_at: float


class InMemoryPrefixIndex:
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._holders: dict[BlockHash, set[WorkerKey]] = {}
        self._hashes: dict[WorkerKey, set[BlockHash]] = {}
        self._leases: dict[str, _Lease] = {}
        self._highest_epoch: dict[str, int] = {}

    def apply(self, worker: WorkerKey, stored: Sequence[BlockHash], removed: Sequence[BlockHash]) -> None:
        if worker.epoch < self._highest_epoch.get(worker.worker_id, 0):
            return
        mine = self._hashes.setdefault(worker, set())
        for h in stored:
            self._holders.setdefault(h, set()).add(worker)
            mine.add(h)
        for h in removed:
            self._drop(worker, h)
            mine.discard(h)

    def replace(self, worker: WorkerKey, hashes: Iterable[BlockHash]) -> None:
        wanted = set(hashes)
        held = self._hashes.get(worker, set())
        self.apply(worker, sorted(wanted - held), sorted(held - wanted))

    def match(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        if not block_hashes:
            return {}
        current = {w for w in self._holders.get(block_hashes[0], ()) if self._is_current(w)}
        depth: dict[str, int] = {}
        for i, h in enumerate(block_hashes[1:], start=1):
            holders = self._holders.get(h, set())
            for w in [w for w in current if w not in holders]:
                depth[w.worker_id] = i
                current.discard(w)
            if not current:
                break
        depth.update({w.worker_id: len(block_hashes) for w in current})
        return depth

    def worker_hashes(self, worker_id: str) -> set[BlockHash]:
        held: set[BlockHash] = set()
        for w, hashes in self._hashes.items():
            if w.worker_id == worker_id:
                held |= hashes
        return held

    def remove_worker(self, worker_id: str) -> None:
        for w in [w for w in self._hashes if w.worker_id == worker_id]:
            self._forget(w)
        self._leases.pop(worker_id, None)

    def set_live(self, worker: WorkerKey, ttl_s: float) -> Lease:
        check_ttl(ttl_s)
        if worker.epoch < self._highest_epoch.get(worker.worker_id, 0):
            return Lease.SUPERSEDED
        self._highest_epoch[worker.worker_id] = worker.epoch
        renewed = self._is_current(worker)
        self._leases[worker.worker_id] = _Lease(worker.epoch, self._clock() + ttl_s)
        return Lease.RENEWED if renewed else Lease.STARTED

    def live_workers(self) -> dict[str, int]:
        now = self._clock()
        return {wid: lease.epoch for wid, lease in self._leases.items() if lease.expires_at > now}

    def sweep(self) -> int:
        dead = [w for w in self._hashes if not self._is_current(w)]
        return sum(self._forget(w) for w in dead)

    def drop_older_epochs(self, worker: WorkerKey) -> int:
        older = [w for w in self._hashes if w.worker_id == worker.worker_id and w.epoch < worker.epoch]
        return sum(self._forget(w) for w in older)

    def touch(self, worker: WorkerKey, every_s: float) -> None:
        return None  # entries here live until removed

    def _is_current(self, worker: WorkerKey) -> bool:
        lease = self._leases.get(worker.worker_id)
        return lease is not None and lease.epoch == worker.epoch and lease.expires_at > self._clock()

    def _drop(self, worker: WorkerKey, h: BlockHash) -> None:
        holders = self._holders.get(h)
        if holders is not None:
            holders.discard(worker)
            if not holders:
                del self._holders[h]

    def _forget(self, worker: WorkerKey) -> int:
        hashes = self._hashes.pop(worker, set())
        for h in hashes:
            self._drop(worker, h)
        return len(hashes)
