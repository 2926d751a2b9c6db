"""IndexPublisher: ships a worker's KV cache events to a PrefixIndex from a thread of its own.

    engine step (engine lock held) --publish(events)--> pending: hash -> stored? (bounded)
    publisher thread, in order, each call through the worker's circuit breaker:
        once      drop_older_epochs: what this worker's earlier incarnations left
        on demand resync: replace this epoch's entries with the pool's cached hashes
        always    apply the pending hashes, at most APPLY_BATCH per call
        every touch_s  touch: renew the life of this epoch's entries (they expire otherwise)

publish() never waits on the index and never raises for it: it folds events into the
pending map under a short lock. Within a batch and while the index is away, only the last
event of each hash matters (fold_events), so events coalesce: the map holds one entry per
hash. Past max_pending hashes it is dropped and the publisher marks itself out of sync.

Out of sync means the index may claim blocks the worker has evicted, or miss some it holds
(costing a recompute or a prefix hit, never a wrong answer). The publisher then resyncs as
soon as the index answers: it reads the pool's cached hashes and replaces its entries with
them. It does so after an overflow, after any write that failed (a failed or timed-out
script may have written part of its work), and when asked (resync(): the lease came back
Lease.STARTED, so the store may have lost everything). The resync runs on this thread, in
order with the applies, so an event published after the pool was read is applied after the
replace; replaying older pending events on top of the replace is harmless, since each one is
the last event of its hash and the pool already reflects it.

Lifecycle: created -> start(cached_hashes) -> running -> stop() -> stopped. publish() may
come before start(): events wait in the map. The thread never dies of an error: it logs it
and retries after the breaker's pause.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

from pdserve.engine.events import BlockRemoved, BlockStored, KVEvent, index_key
from pdserve.engine.hashing import BlockHash
from pdserve.index.base import PrefixIndex, StoreUnavailable, WorkerKey
from pdserve.index.breaker import CircuitBreaker, CircuitOpen

log = logging.getLogger(__name__)

MAX_PENDING_HASHES = 65_536  # ~2 MiB of pending map; a resync after overflow costs one pool read
APPLY_BATCH = 4096  # hashes per apply(): one Lua script call of a few milliseconds at most
TOUCH_S = 5.0
_IDLE_POLL_S = 1.0


def fold_events(events: Iterable[KVEvent]) -> tuple[list[BlockHash], list[BlockHash]]:
    """(stored, removed): the index keys whose last event was a store, and those whose last was a
    removal. A block in a lower tier has a key of its own (events.index_key), so a move between
    tiers is a removal of one key and a store of another."""
    last: dict[BlockHash, bool] = {}
    _fold_into(last, events)
    return _split(last)


def _fold_into(last: dict[BlockHash, bool], events: Iterable[KVEvent]) -> None:
    for event in events:
        if isinstance(event, BlockStored):
            last[index_key(event.block_hash, event.tier)] = True
        elif isinstance(event, BlockRemoved):
            last[index_key(event.block_hash, event.tier)] = False
        else:
            raise TypeError(f"unknown KV event {event!r}; expected BlockStored or BlockRemoved")


def _split(last: dict[BlockHash, bool]) -> tuple[list[BlockHash], list[BlockHash]]:
    stored = [h for h, present in last.items() if present]
    removed = [h for h, present in last.items() if not present]
    return stored, removed


class IndexPublisher:
    """A KVEventPublisher for one worker incarnation."""

    def __init__(self, index: PrefixIndex, worker: WorkerKey, breaker: CircuitBreaker | None = None, *,
                 max_pending: int = MAX_PENDING_HASHES, touch_s: float = TOUCH_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_pending < 1 or touch_s <= 0:
            raise ValueError(f"max_pending={max_pending} must be >= 1 and touch_s={touch_s} > 0")
        self.index = index
        self.worker = worker
        self.breaker = breaker or CircuitBreaker()
        self.max_pending = max_pending
        self.touch_s = touch_s
        self._clock = clock
        self._cond = threading.Condition()
        self._pending: dict[BlockHash, bool] = {}
        self._resync_wanted = False
        self._drop_older_wanted = True
        self._working = False
        self._stopping = False
        self._next_touch = 0.0
        self._outage: str | None = None  # what failed, while the index is unavailable
        self._cached_hashes: Callable[[], Iterable[BlockHash]] = list
        self._thread = threading.Thread(target=self._run, name=f"index-publisher-{worker.worker_id}",
                                        daemon=True)
        self.overflows = 0
        self.resyncs = 0

    # --- the engine's side ------------------------------------------------------------------------
    def publish(self, events: list[KVEvent]) -> None:
        if not events:
            return
        with self._cond:
            _fold_into(self._pending, events)
            self._bound_pending()
            self._cond.notify()

    # --- the worker's side ------------------------------------------------------------------------
    def start(self, cached_hashes: Callable[[], Iterable[BlockHash]]) -> None:
        """Start the thread; cached_hashes() reads the pool's cached hashes (for a resync)."""
        self._cached_hashes = cached_hashes
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread (pending events are dropped: the index learns of them from the next
        incarnation, or expiry). A call in flight may take up to the Redis client's timeout."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def resync(self) -> None:
        """Replace this epoch's entries with the pool's cached hashes, on the thread, when it can."""
        with self._cond:
            self._resync_wanted = True
            self._cond.notify()

    @property
    def in_sync(self) -> bool:
        """False from an overflow, a failed write or a resync() until the resync is done."""
        with self._cond:
            return not self._resync_wanted

    @property
    def pending(self) -> int:
        with self._cond:
            return len(self._pending)

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until everything published so far is in the index; False if not within timeout_s."""
        deadline = self._clock() + timeout_s
        with self._cond:
            while self._has_work() or self._working:
                left = deadline - self._clock()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.1))
        return True

    # --- the thread -----------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._wait_for_work():
                    return
                self._working = True
            try:
                ok = self._work()
            except Exception:  # NOTE: a bug here must not end index publishing for the worker's life
                log.exception("index publisher of %s failed; retrying", self.worker.worker_id)
                ok = False
            with self._cond:
                self._working = False
                self._cond.notify_all()
                if not ok and not self._stopping:
                    self._cond.wait(max(0.05, self.breaker.retry_in()))

    def _wait_for_work(self) -> bool:
        """Caller holds the lock. Block until there is work and the breaker would let a call through;
        False when stopping. NOTE: while the breaker is open, publish() wakes nobody for nothing."""
        while not self._stopping:
            paused = self.breaker.retry_in()
            if paused > 0:
                self._cond.wait(paused)
            elif self._has_work() or self._clock() >= self._next_touch:
                return True
            else:
                self._cond.wait(min(_IDLE_POLL_S, self._next_touch - self._clock()))
        return False

    def _has_work(self) -> bool:
        return bool(self._pending) or self._resync_wanted or self._drop_older_wanted

    def _work(self) -> bool:
        """One round; False when the index is unavailable (the caller pauses)."""
        try:
            self._drop_older_epochs()
            self._resync_if_wanted()
            self._apply_a_batch()
            self._touch_if_due()
        except StoreUnavailable as e:
            self._note_outage(e)
            return False
        if self._outage is not None:
            log.info("prefix index answers again; %s's entries are current", self.worker.worker_id)
            self._outage = None
        return True

    def _drop_older_epochs(self) -> None:
        if self._drop_older_wanted:
            dropped = self.breaker.run(lambda: self.index.drop_older_epochs(self.worker))
            self._drop_older_wanted = False
            if dropped:
                log.info("dropped %d index entries of %s's earlier incarnations", dropped,
                         self.worker.worker_id)

    def _resync_if_wanted(self) -> None:
        with self._cond:
            if not self._resync_wanted:
                return
            self._resync_wanted = False  # NOTE: cleared first, so an overflow meanwhile asks again
        try:
            hashes = list(self._cached_hashes())  # read before the replace; later events follow it
            self.breaker.run(lambda: self.index.replace(self.worker, hashes))
        except BaseException:
            with self._cond:
                self._resync_wanted = True
            raise
        self.resyncs += 1

    def _apply_a_batch(self) -> None:
        with self._cond:
            if not self._pending:
                return
            hashes = list(self._pending)[:APPLY_BATCH]
            batch = {h: self._pending.pop(h) for h in hashes}
        stored, removed = _split(batch)
        try:
            self.breaker.run(lambda: self.index.apply(self.worker, stored, removed))
        except CircuitOpen:
            self._put_back(batch)
            raise
        except StoreUnavailable:
            self._put_back(batch)
            with self._cond:
                self._resync_wanted = True  # a failed script may have done part of its work
            raise

    def _touch_if_due(self) -> None:
        if self._clock() < self._next_touch:
            return
        self.breaker.run(lambda: self.index.touch(self.worker, self.touch_s))
        self._next_touch = self._clock() + self.touch_s

    def _put_back(self, batch: dict[BlockHash, bool]) -> None:
        """Return an unapplied batch; events published meanwhile are newer, so they win."""
        with self._cond:
            batch.update(self._pending)
            self._pending = batch
            self._bound_pending()

    def _bound_pending(self) -> None:
        """Caller holds the lock."""
        if len(self._pending) > self.max_pending:
            self._pending.clear()
            self._resync_wanted = True
            self.overflows += 1
            log.warning("index events of %s overflowed %d pending hashes; it resyncs from its pool once "
                        "the index answers", self.worker.worker_id, self.max_pending)

    def _note_outage(self, error: StoreUnavailable) -> None:
        if self._outage is None and not isinstance(error, CircuitOpen):
            log.warning("prefix index unavailable; %s keeps its KV events (%d hashes pending) until it "
                        "answers: %s", self.worker.worker_id, self.pending, error)
            self._outage = str(error)
