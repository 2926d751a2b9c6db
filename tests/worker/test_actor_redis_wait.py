"""A worker that starts (or Ray restarts) while Redis is unreachable waits for it, then registers.

Before, its constructor failed at once (the epoch is a Redis INCR); Ray counts that as a
restart and gives up after max_restarts, which the soak run hit.
"""

from __future__ import annotations

import threading
import time

import pytest
import redis

from decode_worker.actor import DecodeWorker
from deploy.redis_server import RedisServer
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.index.base import StoreUnavailable
from pdserve.index.registry import WorkerRegistry
from pdserve.worker.actor import WorkerSpec, redis_client


@pytest.mark.slow
def test_a_worker_starting_while_redis_is_down_waits_and_registers():
    server = RedisServer()
    url = server.start()
    server.kill()
    spec = WorkerSpec(role="decode", worker_id="decode-w", redis_url=url,
                      engine=EngineConfig(cache=CacheConfig(num_blocks=16), num_threads=1), metrics_port=None,
                      namespace="t-wait", redis_wait_s=60.0)
    outcome: dict = {}

    def construct() -> None:
        try:
            outcome["actor"] = DecodeWorker(spec)
        except Exception as e:  # what the test reports if the wait does not happen
            outcome["error"] = e

    builder = threading.Thread(target=construct)
    builder.start()
    time.sleep(2.0)
    server.start()  # from this (long-lived) thread: redis-server dies with the thread that started it
    builder.join(120)
    try:
        assert "error" not in outcome, outcome.get("error")
        actor = outcome["actor"]
        live = WorkerRegistry(redis.Redis.from_url(url), "t-wait").live_workers()
        assert [(w.worker_id, w.epoch) for w in live] == [("decode-w", actor.epoch)]
    finally:
        if "actor" in outcome:
            outcome["actor"].stop()
        server.stop()


def test_a_worker_holds_one_redis_connection_however_its_threads_overlap():
    """The heartbeat thread and the engine's index publisher share the worker's client. With
    redis-py's default pool, two calls that overlap open a second connection, which the soak saw
    as a worker's descriptor count going up by one; the worker's client has exactly one."""
    with RedisServer() as server:
        admin = redis.Redis.from_url(server.url)
        before = len(admin.client_list())
        client = redis_client(server.url)
        registry = WorkerRegistry(client, "t-one")
        threads = [threading.Thread(target=lambda: [registry.live_workers() for _ in range(200)])
                   for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(admin.client_list()) - before == 1
        client.close()
        admin.close()


def test_a_caller_that_waits_too_long_for_the_connection_sees_the_store_unavailable():
    with RedisServer() as server:
        client = redis_client(server.url, timeout_s=0.2)
        held = client.connection_pool.get_connection()  # the heartbeat, stuck on a slow call
        try:
            with pytest.raises(StoreUnavailable, match="Redis did not answer"):
                WorkerRegistry(client, "t-busy").live_workers()
        finally:
            client.connection_pool.release(held)
        assert WorkerRegistry(client, "t-busy").live_workers() == []
        client.close()
