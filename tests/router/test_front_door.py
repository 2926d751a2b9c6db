"""The router's front door: idle streams cannot starve Generate, and connections are kept and closed
as the ConnectionPolicy says (tiny model, real gRPC sockets, real clients).

Reflection and health need no token, so anyone who can connect may open their streams and hold
them without sending anything. A reflection stream holds a server thread while it is open; on
main, 400 of them took every thread and Generate was refused "Concurrent RPC limit exceeded!".
"""

from __future__ import annotations

import threading
import time
from contextlib import ExitStack

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pdserve.engine.sequence import SamplingParams
from pdserve.grpc_options import ConnectionPolicy
from router.server import RouterConfig, RouterServer
from tests.conftest import make_engine
from tests.helpers.cluster import ProcessResources, generate_request, running_cluster, start_router
from tests.helpers.grpc_clients import IdleStreams, seconds_until_idle_after_a_call
from tests.helpers.waiting import wait_for
from tests.helpers.workers import wait_until_clean

IDLE_STREAMS = 400
PROMPT = list(range(300, 350))  # 50 tokens: prefilled remotely, its KV pushed to the decode worker


def reflection_stream(channel: grpc.aio.Channel) -> grpc.aio.Call:
    return reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo()  # sends nothing


def health_watch(channel: grpc.aio.Channel) -> grpc.aio.Call:
    return health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())


def list_services(address: str) -> list[str]:
    with grpc.insecure_channel(address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        ask = reflection_pb2.ServerReflectionRequest(list_services="")
        replies = list(stub.ServerReflectionInfo(iter([ask]), timeout=10))
    return [s.name for s in replies[0].list_services_response.service]


@pytest.mark.parametrize("open_call, limit, setting", [
    (reflection_stream, "reflection streams", "max_reflection_streams"),
    (health_watch, "Health.Watch streams", "max_health_watches"),
], ids=["reflection", "health-watch"])
def test_400_idle_open_streams_leave_generate_serving_and_leak_nothing(tiny_loaded, open_call, limit,
                                                                       setting):
    sampling = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = make_engine(tiny_loaded).generate([PROMPT], sampling, detokenize=False)[0].token_ids
    with running_cluster(tiny_loaded) as cluster:
        router = cluster.router
        cap = getattr(router.config, setting)
        list(cluster.stub.Generate(generate_request(list(range(600, 650))), timeout=60))  # opens the channels
        before = ProcessResources.now()
        with IdleStreams(router.address, open_call, IDLE_STREAMS) as idle:
            refused = idle.wait_ended(IDLE_STREAMS - cap, timeout_s=30)
            replies = list(cluster.stub.Generate(generate_request(PROMPT), timeout=60))

            assert [t for r in replies for t in r.token_ids] == expected
            assert replies[-1].prefill_worker  # remote prefill: its KV push got a thread as well
            assert len(refused) == IDLE_STREAMS - cap
            assert {r.code for r in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
            assert f"{cap} {limit} are open on this server; its limit is {cap} (RouterConfig.{setting})" \
                in refused[0].details
            assert wait_for(lambda: router.call_limiter.counts()[limit].in_flight == cap)
            assert router.call_limiter.counts()[limit].refused == IDLE_STREAMS - cap

        assert wait_for(lambda: router.call_limiter.counts()[limit].in_flight == 0)
        assert "pdserve.v1.Generation" in list_services(router.address)  # the limit admits streams again
        # NOTE: the 8 client channels' connections (16 sockets, both ends in this process) are closed;
        # gRPC's pollers open a few sockets of their own once, under the first load, and keep them.
        assert wait_for(lambda: ProcessResources.now().open_fds < before.open_fds + 8), \
            (before, ProcessResources.now())
        wait_until_clean(*cluster.workers, timeout_s=10.0)


def test_router_threads_cover_generate_streams_and_every_open_stream_admitted(tiny_loaded):
    router = RouterServer(RouterConfig(port=0, metrics_port=None), tiny_loaded.tokenizer, lambda: [])
    config = router.config
    assert router.threads() == (config.limits.max_concurrent_streams + config.max_reflection_streams
                                + config.max_health_watches + 16)
    with pytest.raises(ValueError, match="max_reflection_streams must be >= 1, got 0"):
        RouterConfig(max_reflection_streams=0)


# --- connections ---------------------------------------------------------------------------------
@pytest.fixture
def router_with(tiny_loaded):
    """Start a router (no workers) with a ConnectionPolicy; all are stopped at the test's end."""
    with ExitStack() as started:
        def start(policy: ConnectionPolicy) -> RouterServer:
            router = start_router(tiny_loaded, [], connections=policy)
            started.callback(router.stop)
            return router

        yield start


def test_the_router_closes_a_connection_idle_past_the_configured_limit(router_with):
    router = router_with(ConnectionPolicy(max_connection_idle_s=0.3))
    elapsed = seconds_until_idle_after_a_call(router.address)
    assert elapsed is not None and 0.25 <= elapsed < 5.0


def ping_fast_on_a_watch(address: str, seconds: float) -> float | None:
    """A client pinging as fast as it may (gRPC sends about one ping a second) while a Health.Watch is
    open: how long until the server cut it (GOAWAY, the Watch ends UNAVAILABLE), or None when it was
    still open after `seconds`."""
    options = [("grpc.keepalive_time_ms", 100), ("grpc.keepalive_permit_without_calls", 1),
               ("grpc.http2.max_pings_without_data", 0)]
    with grpc.insecure_channel(address, options=options) as channel:
        call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=seconds + 5)
        assert next(call).status == health_pb2.HealthCheckResponse.SERVING
        started, ended = time.monotonic(), threading.Event()
        call.add_done_callback(lambda _: ended.set())
        if not ended.wait(seconds):
            call.cancel()
            return None
        assert call.code() is grpc.StatusCode.UNAVAILABLE
        return time.monotonic() - started


def test_the_router_applies_its_ping_policy(router_with):
    # Our default accepts a ping every 10 s with 2 strikes: this client is cut after about 3 s.
    assert ping_fast_on_a_watch(router_with(ConnectionPolicy()).address, seconds=5.0) is not None
    # NOTE: gRPC's own default accepts a ping only every 5 minutes, so surviving 4 s proves that the
    # configured interval reached the server.
    lenient = ConnectionPolicy(min_client_ping_interval_s=0.05, keepalive_time_s=0.05)
    assert ping_fast_on_a_watch(router_with(lenient).address, seconds=4.0) is None


@pytest.mark.parametrize("field, value, message", [
    ("keepalive_timeout_s", 0, "keepalive_timeout_s must be > 0"),
    ("max_connection_idle_s", -1.0, "max_connection_idle_s must be > 0"),
    ("min_client_ping_interval_s", 60.0, "keepalive_time_s .30. must be >= min_client_ping_interval_s .60."),
])
def test_a_bad_connection_policy_is_refused_with_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        ConnectionPolicy(**{field: value})

