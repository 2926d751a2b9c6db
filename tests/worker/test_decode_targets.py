"""A prefill worker pushes KV only to decode workers the registry lists as live.

First the rule itself (prefill_worker/peers.py, a fake clock), then a real redis-server registry
with a prefill worker asked to push to a registered and to an unregistered decode worker.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import pytest
import redis

from deploy.redis_server import RedisServer
from pdserve.index.registry import WorkerRegistry
from pdserve.worker.server import WorkerConfig, WorkerServer
from prefill_worker.peers import RegisteredDecodeTargets
from prefill_worker.role import PrefillRole
from tests.helpers.rig import Rig, engine_config, reference_tokens
from tests.helpers.workers import wait_until_clean, worker_info, worker_server

PROMPT = list(range(300, 350))


@dataclass(frozen=True)
class Listed:
    role: str
    address: str


class Registry:
    def __init__(self, *workers: Listed) -> None:
        self.workers, self.reads, self.down = list(workers), 0, False

    def live_workers(self) -> list[Listed]:
        self.reads += 1
        if self.down:
            raise ConnectionError("registry down")
        return self.workers


def test_a_listed_decode_worker_is_allowed_and_anything_else_is_not():
    now = [0.0]
    registry = Registry(Listed("decode", "d:1"), Listed("prefill", "p:1"))
    targets = RegisteredDecodeTargets(registry.live_workers, min_refresh_s=1.0, clock=lambda: now[0])
    assert targets.allows("d:1")
    assert not targets.allows("p:1"), "a prefill worker is no decode target"
    assert not targets.allows("evil:1")
    assert registry.reads == 1, "unknown addresses within min_refresh_s do not read the registry again"
    registry.workers.append(Listed("decode", "d:2"))
    now[0] = 1.0
    assert targets.allows("d:2") and registry.reads == 2


def test_with_the_registry_down_the_last_list_read_stands():
    now = [0.0]
    registry = Registry(Listed("decode", "d:1"))
    targets = RegisteredDecodeTargets(registry.live_workers, min_refresh_s=1.0, clock=lambda: now[0])
    assert targets.allows("d:1")
    registry.down, now[0] = True, 5.0
    assert not targets.allows("d:2") and targets.allows("d:1")


@pytest.fixture(scope="module")
def registry():
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        yield WorkerRegistry(client, "targets")
        client.close()


def register(registry: WorkerRegistry, worker: WorkerServer) -> None:
    registry.register(worker_info(worker, epoch=registry.next_epoch(worker.config.worker_id)), ttl_s=60)


def test_a_prefill_naming_an_unregistered_decode_target_is_refused(tiny_loaded, registry):
    decode = worker_server(WorkerConfig("decode", engine_config(), metrics_port=None), tiny_loaded)
    stranger = worker_server(WorkerConfig("decode", engine_config(), metrics_port=None), tiny_loaded)
    targets = RegisteredDecodeTargets(registry.live_workers)
    prefill = WorkerServer(WorkerConfig("prefill", engine_config(), metrics_port=None),
                           PrefillRole(decode_targets=targets), tiny_loaded)
    for worker in (decode, stranger, prefill):
        worker.start()
    register(registry, decode)
    register(registry, prefill)
    rig = Rig("grpc", prefill, decode, gate=None)
    try:
        reply = rig.remote_prefill("listed", PROMPT)
        tokens, used = rig.decode_tokens("listed", PROMPT, reply)
        assert used and tokens == reference_tokens(tiny_loaded, PROMPT)

        request = rig.prefill_request("unlisted", PROMPT)
        request.decode_target = stranger.address  # live and serving, but not in the registry
        with pytest.raises(grpc.RpcError) as refused:
            rig.stub(prefill).Prefill(request, timeout=30)
        assert refused.value.code() is grpc.StatusCode.PERMISSION_DENIED
        assert stranger.address in refused.value.details() and "registry" in refused.value.details()
        status = stranger.status()
        assert status.bytes_received == 0 and not status.transfer_outcomes, "KV reached an unlisted worker"
        assert stranger.address not in prefill.role.channels.addresses(), "the prefill worker dialled it"
        wait_until_clean(prefill, decode, stranger)
    finally:
        rig.close()
        stranger.stop()
