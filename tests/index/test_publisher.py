"""IndexPublisher: a real block pool's events reach the index; a Redis outage never stops the engine."""

from __future__ import annotations

import pytest
import redis

from pdserve.engine.block_pool import BlockPool
from pdserve.engine.events import BlockRemoved, BlockStored
from pdserve.engine.hashing import ROOT_PARENT, engine_salt, hash_blocks
from pdserve.index.base import Lease, StoreUnavailable, WorkerKey
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


def test_block_pool_events_reach_the_router_view():
    index = InMemoryPrefixIndex(clock=lambda: 0.0)
    index.set_live(WORKER, 10.0)
    publisher = IndexPublisher(index, WORKER)
    pool = BlockPool(num_blocks=4, block_size=BS)
    system = list(range(100, 108))

    fill(pool, system + [1, 2, 3, 4])
    publisher.publish(pool.drain_events())
    assert index.match(hash_blocks(system + [9, 9, 9, 9], BS, SALT)) == {"d0": 2}

    fill(pool, [7] * 8)  # takes the free block, then evicts the least recently used: the deepest
    publisher.publish(pool.drain_events())
    assert index.worker_hashes("d0") == {pool.block_hash(b) for b in range(4)}
    assert index.match(hash_blocks(system + [1, 2, 3, 4], BS, SALT)) == {"d0": 2}
    assert index.match(hash_blocks([7] * 8, BS, SALT)) == {"d0": 2}


def test_redis_outage_drops_events_then_resync_restores(redis_server, redis_client, namespace):
    index = RedisPrefixIndex(redis_client, namespace)
    index.set_live(WORKER, 30.0)
    publisher = IndexPublisher(index, WORKER)
    publisher.publish([stored(A), stored(B)])
    assert index.match([A, B]) == {"d0": 2}

    redis_server.kill()
    try:
        publisher.publish([stored(C)])  # the engine step goes on
        assert not publisher.in_sync and publisher.dropped_events == 1
        with pytest.raises(StoreUnavailable, match="--redis-url"):
            index.match([A])
        assert not publisher.resync([A, B, C])
    finally:
        redis_server.start()  # same port, empty

    assert index.match([A, B]) == {}
    assert index.set_live(WORKER, 30.0) is Lease.STARTED  # the signal to republish everything
    assert publisher.resync([A, B, C])
    assert publisher.in_sync
    assert index.match([A, B, C]) == {"d0": 3}


def test_redis_index_refuses_a_decoding_client(redis_server):
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    with pytest.raises(ValueError, match="decode_responses=False"):
        RedisPrefixIndex(client)
