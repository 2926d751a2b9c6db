"""The prefix index contract: which live worker holds which KV blocks.

Workers write, the router reads:

    worker: set_live(key, ttl) ... apply(key, stored, removed) ... set_live(key, ttl) ...
    router: match(prompt block hashes) -> {worker_id: consecutive blocks held from the start}

An entry is trusted only while its writer is live *at the epoch it wrote under*. A
worker's lease (set_live) carries its epoch and expires after ttl_s unless renewed. A
restarted worker comes back with a higher epoch, so the blocks its previous process
published stop counting at once, before anyone cleans them up: the new incarnation deletes
them (drop_older_epochs), and the router's periodic sweep() deletes those of workers that are
gone. An older epoch can never take the lease back from a newer one (Lease.SUPERSEDED).

Wrong entries cost speed, never correctness: a worker always checks its own block
pool, and recomputes whatever it does not hold.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from pdserve.engine.hashing import BlockHash

_ENTRY = re.compile(r"^(.+)@(\d+)$")


@dataclass(frozen=True)
class WorkerKey:
    """A worker process: its stable id and the epoch of this incarnation."""

    worker_id: str
    epoch: int

    def __post_init__(self) -> None:
        if not self.worker_id:
            raise ValueError("worker_id is empty; give each worker a stable, non-empty id")
        if self.epoch < 0:
            raise ValueError(f"epoch {self.epoch} of worker {self.worker_id!r} is negative; "
                             "take epochs from WorkerRegistry.next_epoch()")


def entry_member(worker: WorkerKey) -> str:
    """How a worker-epoch is named in the store and its feed: 'worker_id@epoch'."""
    return f"{worker.worker_id}@{worker.epoch}"


def parse_entry_member(member: bytes | str) -> WorkerKey:
    text = member.decode() if isinstance(member, bytes) else member
    found = _ENTRY.match(text)
    if found is None:
        raise ValueError(f"{text!r} is not a 'worker_id@epoch' index entry; was the namespace shared?")
    return WorkerKey(found.group(1), int(found.group(2)))


class Lease(enum.Enum):
    """What set_live found."""

    STARTED = "started"  # no lease was held: first call, expiry, or the store lost it; republish all
    RENEWED = "renewed"  # the same epoch held it and still does
    SUPERSEDED = "superseded"  # a newer epoch of this worker exists: stop publishing, shut down


class StoreUnavailable(RuntimeError):
    """The index's backing store did not answer. Callers degrade (route without prefix hits)."""


def check_ttl(ttl_s: float) -> None:
    if not ttl_s > 0:
        raise ValueError(f"lease ttl_s={ttl_s} must be positive; use a few heartbeat intervals")


class PrefixIndex(Protocol):
    def apply(self, worker: WorkerKey, stored: Sequence[BlockHash], removed: Sequence[BlockHash]) -> None:
        """Record one worker's events: `stored` hashes added, then `removed` hashes dropped.

        Writes from an epoch older than the newest lease seen for the worker are dropped.
        """
        ...

    def replace(self, worker: WorkerKey, hashes: Iterable[BlockHash]) -> None:
        """Make this worker-epoch's entries exactly `hashes` (a resync after lost events)."""
        ...

    def match(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        """Per live worker at its current epoch: how many blocks from the start it holds (0s omitted)."""
        ...

    def worker_hashes(self, worker_id: str) -> set[BlockHash]:
        """Every hash still stored for worker_id under any epoch (live or not yet swept)."""
        ...

    def remove_worker(self, worker_id: str) -> None:
        """Forget worker_id: its entries of every epoch and its lease (not its highest epoch)."""
        ...

    def set_live(self, worker: WorkerKey, ttl_s: float) -> Lease:
        """Take or renew the worker's lease for ttl_s seconds, unless a newer epoch holds it."""
        ...

    def live_workers(self) -> dict[str, int]:
        """worker_id -> epoch of every worker whose lease has not expired."""
        ...

    def sweep(self) -> int:
        """Delete entries written by dead workers or old epochs; returns how many hashes went."""
        ...

    def drop_older_epochs(self, worker: WorkerKey) -> int:
        """Delete the entries of worker's earlier incarnations (a restarted worker, once); how many
        hashes went."""
        ...

    def touch(self, worker: WorkerKey, every_s: float) -> None:
        """Renew the life of worker's entries where they expire (a slice of them per call, sized so
        that calls every every_s seconds renew them all before they could expire); nothing where
        they do not expire."""
        ...
