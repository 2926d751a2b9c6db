"""A failing engine step fails the requests in flight with INTERNAL and the worker keeps serving."""

from __future__ import annotations

import grpc
import pytest

from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.sequence import SamplingParams
from pdserve.worker.convert import sampling_to_proto
from pdserve.worker.server import WorkerConfig, WorkerServer
from protos.pdserve.v1 import worker_pb2, worker_pb2_grpc
from tests.conftest import make_engine

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture()
def decode_worker(tiny_loaded):
    engine = EngineConfig(cache=CacheConfig(num_blocks=32), device="cpu")
    server = WorkerServer(WorkerConfig("decode", engine), tiny_loaded)
    server.start()
    yield server
    server.stop()


def decode(server, rid: str, prompt: list[int]):
    stub = worker_pb2_grpc.WorkerStub(grpc.insecure_channel(server.address))
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
