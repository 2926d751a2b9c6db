"""IndexPublisher: a real block pool's events reach the index from the publisher's thread; publish()
never waits on the index, events coalesce while it is away, an overflow or a failed write ends in a
resync from the pool, and a Redis outage never stops the engine."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from pdserve.engine.block_pool import BlockPool
from pdserve.engine.events import BlockRemoved, BlockStored
from pdserve.engine.hashing import ROOT_PARENT, engine_salt, hash_blocks
from pdserve.index.base import Lease, StoreUnavailable, WorkerKey
from pdserve.index.breaker import CircuitBreaker
from pdserve.index.memory import InMemoryPrefixIndex
from pdserve.index.publisher import IndexPublisher, fold_events
from pdserve.index.redis_index import RedisPrefixIndex

BS = 4
SALT = engine_salt("tiny", BS, "float32")
A, B, C = b"a" * 16, b"b" * 16, b"c" * 16
WORKER = WorkerKey("d0", 1)


def stored(h: bytes, block_id: int = 0) -> BlockStored:
    return BlockStored(h, None, (1, 2, 3, 4), block_id)


def test_fold_keeps_only_each_hash_last_event():
    events = [stored(A), stored(B), BlockRemoved(A, 0), BlockRemoved(C, 2), stored(C, 3)]

    assert fold_events(events) == ([B, C], [A])


def test_fold_rejects_unknown_events():
    with pytest.raises(TypeError, match="BlockStored or BlockRemoved"):
        fold_events([object()])  # type: ignore[list-item]


def fill(pool: BlockPool, tokens: list[int]) -> list[int]:
    """Compute a prompt into the pool (commit every full block), then release it to the cache."""
    hashes = hash_blocks(tokens, BS, SALT)
    ids = pool.allocate(len(hashes))
    for i, (block_id, h) in enumerate(zip(ids, hashes)):
        pool.commit(block_id, h, hashes[i - 1] if i else ROOT_PARENT, tokens[i * BS:(i + 1) * BS])
    pool.release(ids)
    return ids


@pytest.fixture
def started():
    """Start publishers; stop them after the test (their threads end)."""
    running: list[IndexPublisher] = []

    def start(publisher: IndexPublisher, cached=list) -> IndexPublisher:
        publisher.start(cached)
        running.append(publisher)
        return publisher

    yield start
    for publisher in running:
        publisher.stop()
        assert not publisher._thread.is_alive()


def test_block_pool_events_reach_the_router_view(started):
    index = InMemoryPrefixIndex(clock=lambda: 0.0)
    index.set_live(WORKER, 10.0)
    publisher = started(IndexPublisher(index, WORKER))
    pool = BlockPool(num_blocks=4, block_size=BS)
    system = list(range(100, 108))

    fill(pool, system + [1, 2, 3, 4])
    publisher.publish(pool.drain_events())
    assert publisher.wait_idle(5)
    assert index.match(hash_blocks(system + [9, 9, 9, 9], BS, SALT)) == {"d0": 2}

    fill(pool, [7] * 8)  # takes the free block, then evicts the least recently used: the deepest
    publisher.publish(pool.drain_events())
    assert publisher.wait_idle(5)
    assert index.worker_hashes("d0") == {pool.block_hash(b) for b in range(4)}
    assert index.match(hash_blocks(system + [1, 2, 3, 4], BS, SALT)) == {"d0": 2}
    assert index.match(hash_blocks([7] * 8, BS, SALT)) == {"d0": 2}


class HungIndex(InMemoryPrefixIndex):
    """An index whose writes hang until released, or fail while `failing` (a unit-test fake)."""

    def __init__(self) -> None:
        super().__init__(clock=lambda: 0.0)
        self.release = threading.Event()
        self.failing = False
        self.applied: list[tuple[list[bytes], list[bytes]]] = []

    def apply(self, worker, stored, removed):
        self.release.wait()
        if self.failing:
            raise StoreUnavailable("Redis refused apply(): OOM command not allowed")
        self.applied.append((list(stored), list(removed)))
        super().apply(worker, stored, removed)


def test_publish_never_waits_on_the_index_and_events_coalesce_while_it_hangs(started):
    index = HungIndex()
    index.set_live(WORKER, 10.0)
    publisher = started(IndexPublisher(index, WORKER))
    began = time.perf_counter()
    for _ in range(200):  # what 200 engine steps hand over while Redis hangs
        publisher.publish([stored(A), stored(B), BlockRemoved(A, 0), stored(C)])
        publisher.publish([BlockRemoved(C, 3), stored(A)])
    assert time.perf_counter() - began < 0.5
    assert publisher.pending <= 3  # one entry per hash, however many events

    index.release.set()
    assert publisher.wait_idle(5)
    assert index.worker_hashes("d0") == {A, B}
    assert len(index.applied) <= 2  # the hung call's batch, then everything else folded into one


def test_a_failed_write_keeps_the_events_and_resyncs_once_the_index_answers(started):
    index = HungIndex()
    index.set_live(WORKER, 10.0)
    index.failing = True
    index.release.set()
    publisher = started(IndexPublisher(index, WORKER, CircuitBreaker(open_s=0.05)), cached=lambda: [A, C])
    publisher.publish([stored(A), stored(B)])
    deadline = time.monotonic() + 5
    while publisher.in_sync and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not publisher.in_sync and publisher.pending == 2

    index.failing = False
    assert publisher.wait_idle(5) and publisher.in_sync
    # the resync read the pool ([A, C]) and replaced; the pending events were replayed after it
    assert index.worker_hashes("d0") == {A, B, C} and publisher.resyncs == 1


def test_overflow_drops_the_queue_and_resyncs_from_the_pool(started):
    index = HungIndex()
    index.set_live(WORKER, 10.0)
    publisher = started(IndexPublisher(index, WORKER, max_pending=4), cached=lambda: [B, C])
    publisher.publish([stored(A)])  # taken by the thread, which hangs in apply()
    deadline = time.monotonic() + 5
    while publisher.pending and time.monotonic() < deadline:
        time.sleep(0.01)
    publisher.publish([stored(bytes([i]) * 16) for i in range(5)])  # 5 > max_pending
    assert publisher.pending == 0 and not publisher.in_sync and publisher.overflows == 1

    index.release.set()
    assert publisher.wait_idle(5) and publisher.in_sync
    assert index.worker_hashes("d0") == {B, C}  # what the pool holds, not what the queue lost


def test_a_new_incarnation_drops_its_older_epochs_first(started):
    index = InMemoryPrefixIndex(clock=lambda: 0.0)
    old, new = WorkerKey("d0", 1), WorkerKey("d0", 2)
    index.set_live(old, 10.0)
    index.apply(old, [A, B], [])
    index.set_live(new, 10.0)
    publisher = started(IndexPublisher(index, new))
    publisher.publish([stored(C)])
    assert publisher.wait_idle(5)
    assert index.worker_hashes("d0") == {C}


def test_redis_outage_keeps_events_then_resync_restores(redis_server, redis_client, namespace, started):
    index = RedisPrefixIndex(redis_client, namespace)
    index.set_live(WORKER, 30.0)
    publisher = started(IndexPublisher(index, WORKER, CircuitBreaker(open_s=0.1)), cached=lambda: [A, B, C])
    publisher.publish([stored(A), stored(B)])
    assert publisher.wait_idle(5)
    assert index.match([A, B]) == {"d0": 2}

    redis_server.kill()
    try:
        publisher.publish([stored(C)])  # the engine step goes on
        with pytest.raises(StoreUnavailable, match="--redis-url"):
            index.match([A])
        assert not publisher.wait_idle(0.5) and publisher.pending == 1
    finally:
        redis_server.start()  # same port, empty

    assert publisher.wait_idle(10)
    assert index.set_live(WORKER, 30.0) is Lease.STARTED  # the signal to republish everything
    publisher.resync()
    assert publisher.wait_idle(10) and publisher.in_sync
    assert index.match([A, B, C]) == {"d0": 3}


def test_redis_index_refuses_a_decoding_client(redis_server):
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    with pytest.raises(ValueError, match="decode_responses=False"):
        RedisPrefixIndex(client)


def test_a_block_that_moves_down_a_tier_is_published_under_that_tiers_key():
    from pdserve.engine.events import BlockRemoved, BlockStored, Tier, index_key
    from pdserve.index.publisher import fold_events
    h = b"\x07" * 16
    stored, removed = fold_events([BlockStored(h, None, (1,), 0), BlockRemoved(h, 0),
                                   BlockStored(h, None, (1,), 3, Tier.HOST)])
    assert stored == [index_key(h, Tier.HOST)] and removed == [h]
