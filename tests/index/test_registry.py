"""WorkerRegistry against a real redis-server: epochs, leases, load, deregistration."""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import pytest
import redis

from pdserve.engine.hashing import engine_salt
from pdserve.index.base import Lease, WorkerKey
from pdserve.index.redis_index import RedisPrefixIndex
from pdserve.index.redis_layout import EPOCH_RETAIN_S, RedisKeys
from pdserve.index.registry import StaleEpoch, WorkerInfo, WorkerRegistry

TTL = 30.0
SHORT_TTL = 0.3


@pytest.fixture
def registry(redis_client, namespace) -> WorkerRegistry:
    return WorkerRegistry(redis_client, namespace)


def make_info(worker_id: str = "p0", epoch: int = 1, role: str = "prefill", **kw) -> WorkerInfo:
    fields = dict(worker_id=worker_id, role=role, address="127.0.0.1:7001", node="node-a",
                  model_fingerprint="smollm2-135m", block_size=16, kv_dtype="float32",
                  salt=engine_salt("smollm2-135m", 16, "float32").hex(), num_blocks=512, epoch=epoch)
    return WorkerInfo(**(fields | kw))


def test_epochs_increase_across_restarts(registry):
    first = registry.next_epoch("p0")
    registry.register(make_info(epoch=first), TTL)

    second = registry.next_epoch("p0")

    assert second > first
    assert registry.live_workers() == []  # a new epoch ends the old incarnation's lease at once
    registry.register(make_info(epoch=second), TTL)
    assert [w.epoch for w in registry.live_workers()] == [second]


def test_an_expired_epoch_counter_never_hands_out_an_older_epoch(registry, redis_client, namespace):
    """The counter expires EPOCH_RETAIN_S after the worker's last renewal (or Redis restarts empty); the
    next epoch is seeded from the server's clock, so it is still above every one handed out before.
    Before the seed, it started again at 1 and an old incarnation could take the lease back."""
    keys = RedisKeys(namespace)
    old = registry.next_epoch("p0")
    registry.register(make_info(epoch=old), TTL)
    assert 0 < redis_client.pttl(keys.epoch("p0")) <= EPOCH_RETAIN_S * 1000

    redis_client.delete(keys.epoch("p0"))  # what expiry does
    new = registry.next_epoch("p0")

    assert new > old
    assert registry.heartbeat(make_info(epoch=old), TTL) is Lease.SUPERSEDED


def test_every_registry_key_expires(registry, redis_client, namespace):
    info = make_info(epoch=registry.next_epoch("p0"))
    registry.register(info, TTL)
    registry.heartbeat(info, TTL, {"active": 1})

    names = redis_client.keys(f"{namespace}:*")
    assert len(names) == 5  # live, epoch, info, load, workers
    assert all(redis_client.pttl(k) > 0 for k in names)


def test_a_renewal_only_moves_expiry_so_a_full_redis_keeps_the_lease(registry, redis_client, namespace):
    info = make_info(epoch=registry.next_epoch("p0"))
    registry.register(info, SHORT_TTL)
    redis_client.config_set("maxmemory-policy", "noeviction")
    redis_client.config_set("maxmemory", "1")  # every write that needs memory is refused
    try:
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            redis_client.set("grow", "x")
        for _ in range(3):
            time.sleep(SHORT_TTL / 2)
            assert registry.heartbeat(info, SHORT_TTL, {"active": 2}) is Lease.RENEWED
        assert registry.live_workers() == [info]
    finally:
        redis_client.config_set("maxmemory", "0")


def test_malformed_entries_are_skipped_with_a_warning_naming_the_key(registry, redis_client, namespace,
                                                                      caplog):
    keys = RedisKeys(namespace)
    good = make_info(epoch=registry.next_epoch("p0"))
    registry.register(good, TTL)
    redis_client.hset(keys.info("junk"), mapping={"role": "banana"})
    redis_client.hset(keys.info("other-id"), mapping=replace(good, worker_id="p1").to_fields())
    for w in ("junk", "other-id"):
        redis_client.set(keys.live(w), "1", px=60_000)
        redis_client.sadd(keys.workers, w)
    redis_client.hset(keys.load("p0"), mapping={"active": "3", "queue": "lots"})
    caplog.set_level(logging.WARNING)

    assert registry.live_workers() == [good]
    assert registry.load_of("p0") == {"active": 3}
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert keys.info("junk") in warned and keys.info("other-id") in warned and keys.load("p0") in warned
    caplog.clear()
    assert registry.live_workers() == [good]
    assert not caplog.records  # once per key: the router reads them on every refresh


def test_forget_departed_drops_ids_whose_lease_is_gone(registry, redis_client, namespace):
    stays = make_info("p0", epoch=registry.next_epoch("p0"))
    goes = make_info("p1", epoch=registry.next_epoch("p1"))
    registry.register(stays, TTL)
    registry.register(goes, SHORT_TTL)
    assert registry.forget_departed() == 0
    time.sleep(SHORT_TTL + 0.15)

    assert registry.forget_departed() == 1
    assert redis_client.smembers(RedisKeys(namespace).workers) == {b"p0"}
    assert registry.heartbeat(goes, TTL) is Lease.STARTED  # back: listed again
    assert [w.worker_id for w in registry.live_workers()] == ["p0", "p1"]


def test_an_old_incarnation_cannot_register_or_heartbeat(registry):
    old, new = registry.next_epoch("p0"), registry.next_epoch("p0")
    registry.register(make_info(epoch=new), TTL)

    with pytest.raises(StaleEpoch, match="next_epoch"):
        registry.register(make_info(epoch=old), TTL)
    assert registry.heartbeat(make_info(epoch=old), TTL, {"active": 9}) is Lease.SUPERSEDED
    assert registry.load_of("p0") == {}
    assert [w.epoch for w in registry.live_workers()] == [new]


def test_register_round_trips_info_and_lists_only_live_workers(registry):
    p = make_info("p0", epoch=registry.next_epoch("p0"))
    d = make_info("d0", epoch=registry.next_epoch("d0"), role="decode", address="127.0.0.1:7102",
                  kv_dtype="bfloat16", salt=engine_salt("smollm2-135m", 16, "bfloat16").hex())
    assert registry.register(p, TTL) is Lease.STARTED
    assert registry.register(d, SHORT_TTL) is Lease.STARTED

    assert registry.live_workers() == [d, p]
    time.sleep(SHORT_TTL + 0.15)
    assert registry.live_workers() == [p]
    assert registry.heartbeat(d, TTL) is Lease.STARTED  # came back after expiry: republish
    assert registry.live_workers() == [d, p]


def test_an_entry_without_lower_tier_blocks_reads_as_no_lower_tier(registry, redis_client, namespace):
    """An older worker's entry (mid rolling upgrade) lacks the defaulted field; it is read, not skipped."""
    tiered = make_info("d0", epoch=registry.next_epoch("d0"), role="decode", lower_tier_blocks=64)
    registry.register(tiered, TTL)
    assert registry.live_workers() == [tiered]

    redis_client.hdel(RedisKeys(namespace).info("d0"), "lower_tier_blocks")

    assert registry.live_workers() == [replace(tiered, lower_tier_blocks=0)]


def test_a_worker_with_a_host_tier_lists_its_lower_tier_blocks_for_the_router():
    """router/workers.py tiered() reads this; 0 makes the router skip that worker's lower-tier keys."""
    from types import SimpleNamespace

    import torch

    from pdserve.engine.block_pool import BlockPool
    from pdserve.engine.host_tier import HostTier

    def engine(pool):
        return SimpleNamespace(fingerprint="smollm2-135m", block_size=16, pool=pool,
                               config=SimpleNamespace(cache=SimpleNamespace(kv_dtype="float32")),
                               salt=engine_salt("smollm2-135m", 16, "float32"))

    kv = torch.zeros(2, 2, 8, 16, 1, 4)
    tiered = WorkerInfo.of_engine(engine(BlockPool(8, 16, HostTier(kv, 24))), "d0", "decode", "a:1", "n", 1)
    plain = WorkerInfo.of_engine(engine(BlockPool(8, 16)), "d1", "decode", "a:2", "n", 1)
    assert (tiered.lower_tier_blocks, plain.lower_tier_blocks) == (24, 0)


def test_load_round_trip(registry):
    info = make_info(epoch=registry.next_epoch("p0"))
    registry.register(info, TTL)

    assert registry.load_of("p0") == {}
    assert registry.heartbeat(info, TTL, {"active_requests": 3, "used_blocks": 120}) is Lease.RENEWED
    assert registry.load_of("p0") == {"active_requests": 3, "used_blocks": 120}
    registry.heartbeat(info, TTL, {"active_requests": 0})
    assert registry.load_of("p0") == {"active_requests": 0}


def test_deregister(registry):
    info = make_info(epoch=registry.next_epoch("p0"))
    registry.register(info, TTL)
    registry.heartbeat(info, TTL, {"active_requests": 1})

    registry.deregister("p0")

    assert registry.live_workers() == []
    assert registry.load_of("p0") == {}
    assert registry.next_epoch("p0") == info.epoch + 1


def test_registry_and_index_share_one_lease(registry, redis_client, namespace):
    index = RedisPrefixIndex(redis_client, namespace)
    info = make_info(epoch=registry.next_epoch("p0"))
    registry.register(info, TTL)
    index.apply(info.key, [b"\x01" * 16], [])

    assert index.live_workers() == {"p0": info.epoch}
    assert index.match([b"\x01" * 16]) == {"p0": 1}

    registry.next_epoch("p0")  # the worker restarts
    assert index.match([b"\x01" * 16]) == {}
    assert index.set_live(WorkerKey("p0", info.epoch), TTL) is Lease.SUPERSEDED


def test_worker_info_is_validated():
    with pytest.raises(ValueError, match="role"):
        make_info(role="both")
    with pytest.raises(ValueError, match="positive"):
        replace(make_info(), num_blocks=0)
    with pytest.raises(ValueError, match="kv_dtype 'int4'"):
        replace(make_info(), kv_dtype="int4")
    with pytest.raises(ValueError, match="expected the hex of 16 bytes"):
        replace(make_info(), salt="beef")
