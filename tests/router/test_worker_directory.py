"""The router's channel cache: a channel to an address that no live worker has any more (a
restarted worker comes back on a new port) is closed once it has been gone CHANNEL_RETIRE_S
and no request of ours is on it; before, every restart left one open channel behind."""

from __future__ import annotations

import grpc
import pytest

from pdserve.security import SecurityConfig
from router.scoring import Candidate
from router.workers import CHANNEL_RETIRE_S, WorkerDirectory
from tests.helpers.workers import worker_record


class RecordingSecurity(SecurityConfig):
    """Plaintext channels, remembered so the test can see which were closed."""

    def __init__(self) -> None:
        super().__init__()
        self.opened: dict[str, list[grpc.Channel]] = {}

    def open_channel(self, target, options=(), *, internal, aio=False):
        channel = super().open_channel(target, options, internal=internal, aio=aio)
        self.opened.setdefault(target, []).append(channel)
        return channel


def is_closed(channel: grpc.Channel) -> bool:
    try:
        channel.unary_unary("/probe/Probe")(b"", timeout=0.01)
    except ValueError:  # grpc: "Cannot invoke RPC on closed channel!"
        return True
    except grpc.RpcError:  # open, nobody listening
        return False
    return False


class Directory:
    def __init__(self) -> None:
        self.live = [worker_record("decode-0", "decode", "127.0.0.1:1001", epoch=1)]
        self.now = 0.0
        self.security = RecordingSecurity()
        self.directory = WorkerDirectory(lambda: self.live, security=self.security, clock=lambda: self.now)
        self.directory.refresh()

    def restart_worker(self) -> None:
        self.live = [worker_record("decode-0", "decode", "127.0.0.1:1002", epoch=2)]

    def after(self, seconds: float) -> None:
        self.now += seconds
        self.directory.refresh()


@pytest.fixture
def cluster():
    c = Directory()
    yield c
    c.directory.stop()


def test_a_channel_to_a_restarted_workers_old_address_is_closed_after_the_grace(cluster):
    cluster.directory.stub("127.0.0.1:1001")
    old = cluster.security.opened["127.0.0.1:1001"][0]
    cluster.restart_worker()
    cluster.after(1.0)
    cluster.after(CHANNEL_RETIRE_S - 2.0)
    assert not is_closed(old)  # within the grace: the worker may be back in a moment
    cluster.after(2.0)
    assert is_closed(old)


def test_a_channel_that_carries_a_request_stays_open_until_the_request_ends(cluster):
    cluster.directory.stub("127.0.0.1:1001")
    old = cluster.security.opened["127.0.0.1:1001"][0]
    with cluster.directory.track(Candidate("decode-0", "127.0.0.1:1001", 0)):
        cluster.restart_worker()
        cluster.after(1.0)
        cluster.after(CHANNEL_RETIRE_S + 1.0)
        assert not is_closed(old)  # a draining worker's stream is finishing on it
    cluster.after(1.0)
    assert is_closed(old)


def test_an_address_that_comes_back_keeps_its_channel(cluster):
    cluster.directory.stub("127.0.0.1:1001")
    original = cluster.live
    cluster.live = []  # e.g. Redis restarted empty: workers re-register within a heartbeat
    cluster.after(CHANNEL_RETIRE_S - 1.0)
    cluster.live = original
    cluster.after(2.0)
    cluster.live = []
    cluster.after(CHANNEL_RETIRE_S - 1.0)  # the absence is counted afresh
    cluster.directory.stub("127.0.0.1:1001")
    assert len(cluster.security.opened["127.0.0.1:1001"]) == 1
    assert not is_closed(cluster.security.opened["127.0.0.1:1001"][0])


def test_a_retired_address_gets_a_new_channel_when_asked_again(cluster):
    cluster.directory.stub("127.0.0.1:1001")
    cluster.restart_worker()
    cluster.after(1.0)
    cluster.after(CHANNEL_RETIRE_S)
    cluster.directory.stub("127.0.0.1:1001")
    first, second = cluster.security.opened["127.0.0.1:1001"]
    assert is_closed(first) and not is_closed(second)


# --- a worker that leaves the registry: kept while it answers SERVING ------------------------------------

@pytest.fixture
def health_server():
    """A real gRPC health service on a free port (what every worker serves)."""
    from concurrent import futures

    from grpc_health.v1 import health, health_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(0).wait()


def test_a_worker_that_left_the_registry_stays_while_it_answers_serving(health_server):
    """Redis refusing or losing heartbeats lapses every lease; that must not empty the router's view.
    A worker that drains answers NOT_SERVING before it deregisters, and goes."""
    from grpc_health.v1 import health_pb2

    health, address = health_server
    health.set("", health_pb2.HealthCheckResponse.SERVING)
    live = [worker_record("decode-0", "decode", address, epoch=1)]
    directory = WorkerDirectory(lambda: live)
    try:
        directory.refresh()
        live = []
        directory.refresh()
        assert [w.worker_id for w in directory.workers()] == ["decode-0"]
        health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        directory.refresh()
        assert directory.workers() == []
    finally:
        directory.stop()


def test_a_worker_that_left_and_does_not_answer_is_dropped_at_once():
    live = [worker_record("decode-0", "decode", "127.0.0.1:1", epoch=1)]  # nothing listens on port 1
    directory = WorkerDirectory(lambda: live)
    try:
        directory.refresh()
        live.clear()
        directory.refresh()
        assert directory.workers() == []
    finally:
        directory.stop()


def test_the_sweep_goes_through_the_breaker_and_waits_while_a_worker_is_kept(health_server):
    from grpc_health.v1 import health_pb2

    from pdserve.index.base import StoreUnavailable

    health, address = health_server
    health.set("", health_pb2.HealthCheckResponse.SERVING)
    sweeps: list[int] = []
    failing = [True]

    def sweep() -> int:
        sweeps.append(1)
        if failing[0]:
            raise StoreUnavailable("Redis refused sweep(): READONLY")
        return 0

    live = [worker_record("decode-0", "decode", address, epoch=1)]
    directory = WorkerDirectory(lambda: live, sweep=sweep)
    try:
        directory.refresh()
        directory.sweep()
        directory.sweep()  # the breaker opened on the first failure: skipped
        assert len(sweeps) == 1 and directory.breaker.failures == 1
        failing[0] = False
        live = []
        directory.breaker.open_s = 0.0
        directory.refresh()  # decode-0 is kept: it still serves
        directory.sweep()
        assert len(sweeps) == 1
        live = [worker_record("decode-0", "decode", address, epoch=1)]
        directory.refresh()
        directory.sweep()
        assert len(sweeps) == 2
    finally:
        directory.stop()
