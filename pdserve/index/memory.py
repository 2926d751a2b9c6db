"""Pure in-memory prefix matching: BlockHolders (who holds which hash), and InMemoryPrefixIndex, the
reference implementation of the contract for tests and one process.

BlockHolders is the table both in-memory users share: InMemoryPrefixIndex (with leases of its own)
and the router's mirror of the Redis index (pdserve/index/mirror.py, with leases it reads from
Redis). Pure: no I/O. Time comes from the `clock` InMemoryPrefixIndex is given, so tests expire
leases by moving a fake clock instead of sleeping.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from pdserve.engine.hashing import BlockHash
from pdserve.index.base import Lease, WorkerKey, check_ttl

IsCurrent = Callable[[WorkerKey], bool]


class BlockHolders:
    """Which entry (worker-epoch) holds which block hash, both ways, and the longest-prefix match.

    NOTE: every entry is interned (one WorkerKey object per entry): the match walk compares sets of
    entries, and equal-but-distinct dataclass objects would cost a Python __eq__ per comparison
    where the same object costs an identity check.
    """

    def __init__(self) -> None:
        self._holders: dict[BlockHash, set[WorkerKey]] = {}
        self._hashes: dict[WorkerKey, set[BlockHash]] = {}
        self._interned: dict[WorkerKey, WorkerKey] = {}

    def apply(self, worker: WorkerKey, stored: Iterable[BlockHash], removed: Iterable[BlockHash]) -> None:
        """`stored` added, then `removed` dropped (a hash in both ends removed)."""
        worker = self._intern(worker)
        mine = self._hashes.setdefault(worker, set())
        for h in stored:
            self._holders.setdefault(h, set()).add(worker)
            mine.add(h)
        for h in removed:
            self._drop(worker, h)
            mine.discard(h)
        if not mine:
            del self._hashes[worker]
            del self._interned[worker]

    def forget(self, worker: WorkerKey) -> int:
        """Drop every hash of the entry; how many went."""
        hashes = self._hashes.pop(worker, set())
        self._interned.pop(worker, None)
        for h in hashes:
            self._drop(worker, h)
        return len(hashes)

    def entries(self) -> list[WorkerKey]:
        return list(self._hashes)

    def hashes_of(self, worker: WorkerKey) -> set[BlockHash]:
        return set(self._hashes.get(worker, ()))

    def worker_hashes(self, worker_id: str) -> set[BlockHash]:
        held: set[BlockHash] = set()
        for w, hashes in list(self._hashes.items()):
            if w.worker_id == worker_id:
                held |= hashes
        return held

    def match(self, block_hashes: Sequence[BlockHash], is_current: IsCurrent) -> dict[str, int]:
        """Per current entry: how many of block_hashes it holds from the start (0s omitted).

        Walks the prompt once, narrowing the set of entries still matching with C-level set
        operations (a subset test per block), and stops at the first block no candidate holds.
        NOTE: it iterates block_hashes rather than indexing it, so a lazy sequence (the router's
        hashing.PromptHashes) is read, and its blocks hashed, only as far as the walk goes.
        """
        blocks = iter(block_hashes)
        first = next(blocks, None)
        if first is None:
            return {}
        current = {w for w in set(self._holders.get(first, ())) if is_current(w)}
        depth: dict[str, int] = {}
        for i, h in enumerate(blocks, 1):
            if not current:
                break
            holders = self._holders.get(h)
            if holders is None:
                depth.update({w.worker_id: i for w in current})
                return depth
            if not current <= holders:
                depth.update({w.worker_id: i for w in current - holders})
                current &= holders
        depth.update({w.worker_id: len(block_hashes) for w in current})
        return depth

    def _intern(self, worker: WorkerKey) -> WorkerKey:
        return self._interned.setdefault(worker, worker)

    def _drop(self, worker: WorkerKey, h: BlockHash) -> None:
        holders = self._holders.get(h)
        if holders is not None:
            holders.discard(worker)
            if not holders:
                del self._holders[h]


@dataclass(frozen=True)
class _Lease:
    epoch: int
    expires_at: float


class InMemoryPrefixIndex:
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._table = BlockHolders()
        self._leases: dict[str, _Lease] = {}
        self._highest_epoch: dict[str, int] = {}

    def apply(self, worker: WorkerKey, stored: Sequence[BlockHash], removed: Sequence[BlockHash]) -> None:
        if worker.epoch < self._highest_epoch.get(worker.worker_id, 0):
            return
        self._table.apply(worker, stored, removed)

    def replace(self, worker: WorkerKey, hashes: Iterable[BlockHash]) -> None:
        wanted = set(hashes)
        held = self._table.hashes_of(worker)
        self.apply(worker, sorted(wanted - held), sorted(held - wanted))

    def match(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        return self._table.match(block_hashes, self._is_current)

    def worker_hashes(self, worker_id: str) -> set[BlockHash]:
        return self._table.worker_hashes(worker_id)

    def remove_worker(self, worker_id: str) -> None:
        for w in self._table.entries():
            if w.worker_id == worker_id:
                self._table.forget(w)
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
        dead = [w for w in self._table.entries() if not self._is_current(w)]
        return sum(self._table.forget(w) for w in dead)

    def drop_older_epochs(self, worker: WorkerKey) -> int:
        older = [w for w in self._table.entries()
                 if w.worker_id == worker.worker_id and w.epoch < worker.epoch]
        return sum(self._table.forget(w) for w in older)

    def touch(self, worker: WorkerKey, every_s: float) -> None:
        return None  # entries here live until removed

    def _is_current(self, worker: WorkerKey) -> bool:
        lease = self._leases.get(worker.worker_id)
        return lease is not None and lease.epoch == worker.epoch and lease.expires_at > self._clock()
