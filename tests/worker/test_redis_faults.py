"""A misbehaving Redis costs prefix hits, never a request: a real redis-server in four bad states.

    out of memory   maxmemory 1mb, noeviction, filled up: every write that needs memory gets OOM
    read-only       REPLICAOF a master nobody serves: every write gets READONLY
    no permission   the cluster's ACL user loses every command mid-run: NOPERM
    stopped         SIGSTOP for 20 s: connections hang instead of failing

In each, with two decode workers (the production WorkerActor, in this process) behind a router built
as `pdserve up` builds it: rounds of 8 concurrent requests keep completing with exactly the in-process
engine's tokens for longer than a worker lease lives; no engine step waits on Redis (the workers'
pdserve_worker_step_seconds, with the fault and without); and when Redis is well again, the worker
that served a new prompt during the fault is found in the index again and the router sends that
prompt's next request to it, by prefix. Every flow ends with every block free.

Before the fix (seen): OOM, READONLY and NOPERM were raised out of engine.step() by the index
publisher, failing every request in flight; under SIGSTOP each step that published waited for the
Redis socket timeout (1 s).
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from collections.abc import Callable

import pytest
import redis

from deploy.redis_server import RedisServer, free_port
from pdserve.index.breaker import BreakerState
from pdserve.security.redis_auth import redis_url_with_credentials
from tests.helpers.waiting import eventually
from tests.helpers.workers import wait_until_clean
from tests.worker.redis_cluster import LEASE_TTL_S, RedisCluster, StepTimes, sigterm_kept

pytestmark = pytest.mark.slow

PASSWORD = "fault-test-password"
SHARED = list(range(300, 348))  # 3 full blocks every request starts with
FAULT_PROMPT = list(range(600, 660))  # a prefix first seen while Redis misbehaves
AFTER_FAULT_PROMPT = FAULT_PROMPT[:48] + [7, 7, 7]  # its 3 blocks, asked again once Redis is well


def round_of_prompts(cluster: RedisCluster, tag: int) -> list[list[int]]:
    """8 prompts that start with SHARED, none with a greedy near-tie (tests/conftest.py)."""
    candidates = (SHARED + [tag % 50, i] + list(range(400 + i, 410 + i)) for i in itertools.count())
    return list(itertools.islice(filter(cluster.clear_of_near_ties, candidates), 8))


@pytest.fixture
def redis_server():
    with RedisServer(password=PASSWORD) as server:
        yield server


@pytest.fixture
def admin(redis_server):
    client = redis.Redis.from_url(redis_server.url, socket_timeout=5)
    yield client
    client.close()


def run_through_fault(cluster: RedisCluster, inject: Callable[[], None], clear: Callable[[], None],
                      hold_s: float) -> None:
    cluster.start_router()
    workers = cluster.workers
    start = StepTimes.of(workers)
    assert cluster.clear_of_near_ties(FAULT_PROMPT) and cluster.clear_of_near_ties(AFTER_FAULT_PROMPT)
    cluster.concurrently(round_of_prompts(cluster, 0))
    without_fault = StepTimes.of(workers).since(start)

    inject()
    began, start = time.monotonic(), StepTimes.of(workers)
    rounds = 0
    while rounds < 2 or time.monotonic() - began < hold_s:  # past every lease: they lapse in Redis
        rounds += 1
        cluster.concurrently(round_of_prompts(cluster, rounds))
    served = cluster.generate(FAULT_PROMPT)
    with_fault = StepTimes.of(workers).since(start)
    assert cluster.routed_ids() == {"decode-0", "decode-1"}  # the router still sends work to both
    clear()

    summary = (f"steps without the fault: {without_fault.steps}, mean {without_fault.mean_s * 1e3:.1f} ms; "
               f"with it: {with_fault.steps}, mean {with_fault.mean_s * 1e3:.1f} ms, "
               f"{with_fault.slow_steps} over {StepTimes.BOUND_S} s")
    print(summary)
    assert with_fault.steps > 0 and with_fault.slow_steps == 0, summary
    assert with_fault.mean_s <= 3 * without_fault.mean_s + 0.02, summary  # a wait would add ~1 s

    holder = served.decode_worker
    eventually(lambda: cluster.holders(FAULT_PROMPT).get(holder, 0) >= 3, 20,
             f"{holder} publishes the fault-time prompt again")
    breaker = cluster.router.placer.breaker
    eventually(lambda: breaker.state is not BreakerState.OPEN or breaker.retry_in() == 0, 10,
             "the router's breaker lets an index lookup through")
    again = cluster.generate(AFTER_FAULT_PROMPT)
    assert again.decode_worker == holder and again.usage.cached_tokens == 48, again
    wait_until_clean(*cluster.servers, timeout_s=10.0)


@pytest.fixture
def cluster_over(tiny_loaded, tiny_model_dir):
    made: list[RedisCluster] = []

    def make(url: str) -> RedisCluster:
        made.append(RedisCluster(tiny_loaded, str(tiny_model_dir), url))
        return made[-1]

    with sigterm_kept():
        yield make
        for cluster in made:
            cluster.stop()


def test_out_of_memory(redis_server, admin, cluster_over):
    cluster = cluster_over(redis_server.url)

    def fill_up() -> None:
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", "1mb")
        for i in range(100_000):
            try:
                admin.set(f"junk:{i}", b"x" * 1024)
            except redis.exceptions.OutOfMemoryError:
                return
        raise AssertionError("Redis never reported OOM")

    def free() -> None:
        admin.config_set("maxmemory", "0")
        for key in admin.scan_iter("junk:*", count=1000):
            admin.delete(key)

    run_through_fault(cluster, fill_up, free, hold_s=2 * LEASE_TTL_S)


def test_read_only_replica(redis_server, admin, cluster_over):
    cluster = cluster_over(redis_server.url)
    nobody = free_port()
    run_through_fault(cluster, lambda: admin.replicaof("127.0.0.1", nobody),
                      lambda: admin.replicaof("NO", "ONE"), hold_s=2 * LEASE_TTL_S)


def test_acl_permissions_revoked_mid_run(redis_server, admin, cluster_over):
    admin.acl_setuser("pdserve", enabled=True, passwords=["+pdserve-user-password"], keys=["*"],
                      channels=["*"], commands=["+@all"])
    cluster = cluster_over(redis_url_with_credentials(redis_server.url, "pdserve", "pdserve-user-password"))
    run_through_fault(cluster, lambda: admin.execute_command("ACL", "SETUSER", "pdserve", "-@all"),
                      lambda: admin.execute_command("ACL", "SETUSER", "pdserve", "+@all"),
                      hold_s=2 * LEASE_TTL_S)


def test_stopped_for_20_s(redis_server, cluster_over):
    cluster = cluster_over(redis_server.url)
    pid = redis_server.pid
    try:
        run_through_fault(cluster, lambda: os.kill(pid, signal.SIGSTOP), lambda: os.kill(pid, signal.SIGCONT),
                          hold_s=20.0)
    finally:
        os.kill(pid, signal.SIGCONT)  # never leave it stopped, whatever failed
