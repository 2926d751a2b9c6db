"""The router checks the prefix index's predictions against what the worker reused (router/prediction.py)
over a real redis-server, a real worker and the router's mirror of the index: entries wiped from Redis
behind the worker's back drop the index's accuracy for it, the router asks it to resync, and its hits
come back. Tiny model; every flow ends with the leak check."""

from __future__ import annotations

import time

import grpc

from pdserve.index.redis_layout import RedisKeys
from pdserve.status_cli import render
from protos.pdserve.v1 import admin_pb2, admin_pb2_grpc
from tests.helpers.waiting import eventually
from tests.helpers.workers import wait_until_clean
from tests.worker.redis_cluster import RedisCluster, sigterm_kept

SHARED = list(range(2000, 2096))  # 6 blocks of 16: every prompt below reuses them once cached
HITS_BACK_S = 10.0  # the stated time: resync asked -> the index promises the blocks again


def prompt(i: int) -> list[int]:
    return SHARED + [3000 + 8 * i + j for j in range(8)]


def wipe_entries(client, keys: RedisKeys, worker_id: str) -> int:
    """Delete every index key naming the worker, as an eviction or a careless FLUSH of keys would."""
    members = [m for m in client.smembers(keys.entries) if m.decode().startswith(f"{worker_id}@")]
    deleted = 0
    for m in members:
        for block in client.smembers(keys.entry_hashes(m.decode())):
            deleted += client.delete(keys.block(block))
        deleted += client.delete(keys.entry_hashes(m.decode()))
        client.srem(keys.entries, m)
    return deleted


def resyncs(router, worker_id: str) -> float:
    return router.metrics.registry.get_sample_value(
        "pdserve_router_index_resyncs_total", {"worker": worker_id, "outcome": "ok"}) or 0.0


def status_table(router) -> str:
    """`pdserve status`'s table, from the router's Admin service over gRPC."""
    with grpc.insecure_channel(router.address) as channel:
        reply = admin_pb2_grpc.AdminStub(channel).ClusterStatus(admin_pb2.ClusterStatusRequest(), timeout=10)
    assert [w.index_accuracy for w in reply.workers if w.HasField("index_accuracy")] == [1.0]
    return render(reply)


def test_wiped_entries_drop_accuracy_fire_a_resync_and_hits_come_back(redis_server, redis_client, tiny_loaded,
                                                                      tiny_model_dir):
    with sigterm_kept():
        cluster = RedisCluster(tiny_loaded, str(tiny_model_dir), redis_server.url, num_decode=1)
    try:
        router = cluster.start_router()
        tracker, mirror, worker = router.servicer.predictions, router.companions[0], "decode-0"
        cluster.generate(prompt(0))
        eventually(lambda: cluster.holders(SHARED).get(worker) == 6, 10, "the shared blocks in the index")
        for i in range(1, 9):
            assert cluster.generate(prompt(i)).usage.cached_tokens == 96
        assert tracker.accuracy(worker) == 1.0
        assert "1.00" in status_table(router)

        assert wipe_entries(redis_client, RedisKeys(cluster.namespace), worker) > 0
        mirror.resnapshot()  # what its resnapshot_s timer would do: the router now sees Redis as it is
        assert cluster.holders(SHARED) == {}
        wrong = 0
        while tracker.accuracy(worker) is not None and wrong < 8:  # a resync starts a fresh window
            wrong += 1
            # the worker still has them; the router records the pair before it sends the last message
            assert cluster.generate(prompt(100 + wrong)).usage.cached_tokens == 96
        assert wrong == 4  # 8 right, then accuracy 8/12 < 0.7 at the 4th miss
        eventually(lambda: resyncs(router, worker) == 1, 5, "the worker answered the resync")

        asked = time.monotonic()
        eventually(lambda: cluster.holders(SHARED).get(worker) == 6, HITS_BACK_S, "hits back after resync")
        assert time.monotonic() - asked < HITS_BACK_S
        before = router.metrics.registry.get_sample_value("pdserve_router_predicted_cached_tokens_total",
                                                          {"worker": worker})
        cluster.generate(prompt(200))
        after = router.metrics.registry.get_sample_value("pdserve_router_predicted_cached_tokens_total",
                                                         {"worker": worker})
        assert after - before == 96  # the index promises the blocks again, and they were there
        wait_until_clean(*cluster.servers, timeout_s=10.0)
    finally:
        cluster.stop()
