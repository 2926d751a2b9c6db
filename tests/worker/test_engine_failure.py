"""A failing engine step fails the requests in flight with INTERNAL and the worker keeps serving."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.sequence import SamplingParams
from pdserve.worker.convert import sampling_to_proto
from pdserve.worker.server import WorkerConfig
from protos.pdserve.v1 import worker_pb2
from tests.conftest import make_engine
from tests.helpers.waiting import wait_for
from tests.helpers.workers import WorkerStubs, worker_server

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture()
def decode_worker(tiny_loaded):
    engine = EngineConfig(cache=CacheConfig(num_blocks=32), device="cpu")
    server = worker_server(WorkerConfig("decode", engine), tiny_loaded)
    server.start()
    yield server
    server.stop()


def decode(server, rid: str, prompt: list[int]):
    stub = WorkerStubs(grpc.insecure_channel(server.address))
    request = worker_pb2.DecodeRequest(request_id=rid, prompt_token_ids=prompt, prefill_here=True,
                                       sampling=sampling_to_proto(GREEDY))
    return [t for r in stub.Decode(request, timeout=30) for t in r.token_ids]


def test_a_failed_step_is_internal_and_the_next_request_is_exact(decode_worker, tiny_loaded, monkeypatch):
    real_step, calls = decode_worker.engine.step, []

    def fail_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected step failure")
        return real_step(*args, **kwargs)

    monkeypatch.setattr(decode_worker.engine, "step", fail_once)
    with pytest.raises(grpc.RpcError) as failed:
        decode(decode_worker, "a", list(range(100, 120)))
    assert failed.value.code() is grpc.StatusCode.INTERNAL and "engine failed" in failed.value.details()
    status = decode_worker.status()
    assert status.used_blocks == 0 and status.free_blocks == status.num_blocks

    prompt = list(range(200, 230))
    expected = make_engine(tiny_loaded).generate([prompt], GREEDY, detokenize=False)[0].token_ids
    assert decode(decode_worker, "b", prompt) == expected
    assert decode_worker.status().used_blocks == 0


def test_steps_failing_again_and_again_take_the_worker_out_of_service(tiny_loaded, monkeypatch):
    """max_failed_steps failures in a row: health NOT_SERVING, every call UNAVAILABLE (so the
    router goes elsewhere), on_failing called once (the Ray actor leaves the registry there)."""
    reasons: list[str] = []
    engine = EngineConfig(cache=CacheConfig(num_blocks=32), device="cpu")
    server = worker_server(WorkerConfig("decode", engine, max_failed_steps=3, metrics_port=None), tiny_loaded,
                          on_failing=reasons.append)
    server.start()
    try:
        def always_fail(*args, **kwargs):
            raise RuntimeError("injected step failure")

        monkeypatch.setattr(server.engine, "step", always_fail)
        for i in range(3):
            with pytest.raises(grpc.RpcError) as failed:
                decode(server, f"r{i}", list(range(100, 120)))
            assert failed.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE)
        deadline = time.monotonic() + 5
        while not reasons and time.monotonic() < deadline:  # the idle loop fails its steps too
            time.sleep(0.01)
        assert len(reasons) == 1 and "failed 3 steps in a row" in reasons[0]
        with pytest.raises(grpc.RpcError) as refused:
            decode(server, "after", list(range(100, 120)))
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
        assert "out of service" in refused.value.details()
        assert not server.status().serving
        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(server.address))
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == \
            health_pb2.HealthCheckResponse.NOT_SERVING
        status = server.status()
        assert status.used_blocks == 0 and status.free_blocks == status.num_blocks
    finally:
        server.stop()


def test_a_worker_whose_steps_keep_failing_leaves_routing_and_the_others_serve(tiny_loaded, tiny_model_dir):
    """Two decode workers (the production WorkerActor, no Ray) behind a router over a real
    redis-server: decode-0's every step fails. After max_failed_steps it answers health NOT_SERVING
    and leaves the registry; the router drops it, and every later request is served, exactly, by
    decode-1."""
    from deploy.redis_server import RedisServer
    from tests.helpers.waiting import eventually
    from tests.worker.redis_cluster import RedisCluster, sigterm_kept

    with RedisServer(password="step-failure-test") as redis_server, sigterm_kept():
        cluster = RedisCluster(tiny_loaded, str(tiny_model_dir), redis_server.url)
        try:
            cluster.start_router()
            broken = cluster.workers[0]

            def always_fail(*args, **kwargs):
                raise RuntimeError("injected step failure")

            broken.server.engine.step = always_fail  # the engine loop calls it even when idle
            eventually(lambda: not broken.server.status().serving, 10, "decode-0 took itself out of service")
            eventually(lambda: cluster.routed_ids() == {"decode-1"}, 10, "the router dropped decode-0")
            assert "decode-0" not in {w.worker_id for w in cluster.workers[1].registry.live_workers()}
            served = cluster.concurrently([list(range(100 + i, 140 + i)) for i in range(8)])
            assert {r.decode_worker for r in served} == {"decode-1"}
            assert cluster.workers[1].server.status().used_blocks == 0
        finally:
            cluster.stop()


def test_a_drop_that_fails_after_a_call_ends_leaves_the_loop_serving(decode_worker, tiny_loaded, monkeypatch):
    """A cancelled call's request is dropped by the engine loop (EngineLoop.abort_later); a drop that
    raises is logged and the loop goes on serving exact tokens."""
    real_abort, failed = decode_worker.engine.abort, []

    def fail_once_in_the_loop(request_id, parked=True):  # (the stream's own end drops it too, elsewhere)
        if threading.current_thread().name == "engine-loop" and not failed:
            failed.append(request_id)
            raise RuntimeError("injected failure to drop")
        return real_abort(request_id, parked)

    monkeypatch.setattr(decode_worker.engine, "abort", fail_once_in_the_loop)
    stub = WorkerStubs(grpc.insecure_channel(decode_worker.address))
    long = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    request = worker_pb2.DecodeRequest(request_id="cancelled", prompt_token_ids=list(range(300, 320)),
                                       prefill_here=True, sampling=sampling_to_proto(long))
    call = stub.Decode(request, timeout=30)
    next(call)
    call.cancel()
    assert wait_for(lambda: failed == ["cancelled"], timeout_s=5)
    prompt = list(range(200, 230))
    expected = make_engine(tiny_loaded).generate([prompt], GREEDY, detokenize=False)[0].token_ids
    assert decode(decode_worker, "after", prompt) == expected
