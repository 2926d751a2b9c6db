"""The prefix index has a lifecycle: what restarts, departures and junk leave in a real Redis.

Workers are the production WorkerActor (in this process, no Ray); the router is built by
router.redis_backend.redis_router, as `pdserve up` builds it.

Before the fix (seen): each restart left its epoch's hash set, its `entries` member and one member
in every block set it had published (20 restarts: a block set naming 20 entries, and keys growing
with every restart); a departed worker's entries stayed for ever (nothing called sweep()); the
`info:`, `epoch:`, entry and block keys had no TTL; one malformed `info:` hash made live_workers()
raise, so the router kept its stale view and never saw a worker that started afterwards.
"""

from __future__ import annotations

import logging

import pytest
import redis

from decode_worker.actor import DecodeWorker
from pdserve.engine.sequence import SamplingParams
from pdserve.index.redis_layout import RedisKeys
from pdserve.worker.actor import WorkerActor
from tests.helpers.waiting import eventually
from tests.helpers.workers import wait_until_clean
from tests.worker.redis_cluster import RedisCluster, decode_spec, sigterm_kept

pytestmark = pytest.mark.slow

RESTARTS = 20
SHARED = list(range(300, 340))  # 2 full blocks + 8 tokens: the same blocks in every incarnation
# A live worker's own keys: its lease, epoch counter, info and load hashes, its entry's hash set, and
# the namespace's `workers` and `entries` sets, its change feed and the feed's counter. Everything else
# is one block key per hash it holds.
FIXED_KEYS = 9


def serve(actor: WorkerActor, prompt: list[int], request_id: str) -> None:
    """One request through the worker's engine loop (what its Decode RPC drives)."""
    sampling = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outputs = list(actor.server.loop.submit(prompt, sampling, request_id, detokenize=False))
    assert outputs[-1].finished and outputs[-1].finish_reason == "length"


def published(redis_client: redis.Redis, keys: RedisKeys, actor: WorkerActor) -> bool:
    """The index holds exactly what the incarnation's pool caches, under its epoch."""
    held = set(actor.server.engine.pool.cached_hashes())
    return set(redis_client.smembers(keys.entry_hashes(f"{actor.spec.worker_id}@{actor.epoch}"))) == held


def key_and_set_sizes(redis_client: redis.Redis, keys: RedisKeys) -> tuple[int, int]:
    """How many keys the namespace has, and how many entries its largest block set names."""
    names = redis_client.keys(f"{keys.namespace}:*")
    blocks = [k for k in names if k.startswith(keys.block_prefix)]
    return len(names), max((redis_client.scard(k) for k in blocks), default=0)


def check_bounded(redis_client: redis.Redis, keys: RedisKeys, actor: WorkerActor, restart: int) -> None:
    """The bound: one live incarnation's FIXED_KEYS plus one block key per hash it holds, and each
    block set names only that incarnation's entry. Older epochs leave nothing."""
    eventually(lambda: published(redis_client, keys, actor), 10, "the incarnation's blocks published")
    bound = FIXED_KEYS + len(actor.server.engine.pool.cached_hashes())

    def bounded() -> bool:
        count, largest = key_and_set_sizes(redis_client, keys)
        return count <= bound and largest == 1

    try:
        eventually(bounded, 5, "older epochs cleaned up")
    except AssertionError:
        pass  # the assertions below say by how much
    count, largest = key_and_set_sizes(redis_client, keys)
    assert count <= bound, f"restart {restart}: {count} keys, bound {bound}"
    assert largest == 1, f"restart {restart}: a block set names {largest} entries"


def test_twenty_restarts_of_a_decode_worker_leave_redis_bounded(redis_server, redis_client, tiny_model_dir):
    keys = RedisKeys("t-restarts")
    spec = decode_spec("decode-0", redis_server.url, str(tiny_model_dir), keys.namespace, num_blocks=32)
    for restart in range(RESTARTS):
        with sigterm_kept():
            actor = DecodeWorker(spec)  # a restart: the same worker id, a new epoch
        try:
            serve(actor, SHARED, f"shared-{restart}")
            serve(actor, [restart] * 3 + list(range(500, 537)), f"own-{restart}")  # blocks new each time
            check_bounded(redis_client, keys, actor, restart)
        finally:
            actor.stop()
    names = redis_client.keys(f"{keys.namespace}:*")
    assert [k for k in names if redis_client.pttl(k) <= 0] == []  # what the last one left expires on its own


def test_the_router_sweeps_a_worker_that_left(redis_server, redis_client, tiny_loaded, tiny_model_dir):
    with sigterm_kept():
        cluster = RedisCluster(tiny_loaded, str(tiny_model_dir), redis_server.url)
    try:
        cluster.start_router()
        keys = RedisKeys(cluster.namespace)
        leaving = cluster.workers[1]
        serve(leaving, list(range(700, 750)), "before-leaving")
        eventually(lambda: published(redis_client, keys, leaving), 10, "its blocks published")
        leaving.stop()  # scale-down or a drain: deregistered, its process gone
        cluster.workers.remove(leaving)

        def leftovers() -> list[bytes]:
            names = redis_client.keys(f"{keys.namespace}:*")
            mine = [k for k in names if b"decode-1" in k]
            mine += [b"entries:" + m for m in redis_client.smembers(keys.entries)
                     if m.startswith(b"decode-1@")]
            mine += [b"workers:" + m for m in redis_client.smembers(keys.workers) if m == b"decode-1"]
            for k in names:
                if k.startswith(keys.block_prefix):
                    mine += [k + b" names " + m for m in redis_client.smembers(k)
                             if m.startswith(b"decode-1@")]
            return [k for k in mine if k != keys.epoch("decode-1").encode()]

        eventually(lambda: not leftovers(), 15, "the router's sweep removes what decode-1 left")
        assert redis_client.pttl(keys.epoch("decode-1")) > 0  # the epoch counter outlives it, for a while
        assert cluster.routed_ids() == {"decode-0"}
        cluster.generate(list(range(700, 750)))
        wait_until_clean(*cluster.servers, timeout_s=10.0)
    finally:
        cluster.stop()


def test_a_malformed_info_hash_is_skipped_and_routing_keeps_working(redis_server, redis_client, tiny_loaded,
                                                                     tiny_model_dir, caplog):
    with sigterm_kept():
        cluster = RedisCluster(tiny_loaded, str(tiny_model_dir), redis_server.url, num_decode=1)
    try:
        cluster.start_router()
        keys = RedisKeys(cluster.namespace)
        redis_client.hset(keys.info("ghost"), mapping={"role": "banana", "block_size": "many"})
        redis_client.set(keys.live("ghost"), "1", px=60_000)
        redis_client.sadd(keys.workers, "ghost")
        redis_client.sadd(keys.entries, "not-an-entry")
        caplog.set_level(logging.WARNING)
        with sigterm_kept():
            cluster.add_worker("decode-1")

        eventually(lambda: cluster.routed_ids() == {"decode-0", "decode-1"}, 10,
                 "the router sees the worker that started after the junk")
        assert any(keys.info("ghost") in r.getMessage() for r in caplog.records), "no warning names the key"
        for i in range(4):
            cluster.generate(list(range(800 + i, 850 + i)))
        wait_until_clean(*cluster.servers, timeout_s=10.0)
    finally:
        cluster.stop()
