"""Client-side resume (pdserve/client.py GenerationStream, GenerateRequest.continuation): a router that
dies mid-stream does not lose the stream; the client sends it again, with the tokens it already has,
through another router, and gets exactly the tokens an uninterrupted run gives. Tiny model, real
sockets; the decode worker holds the stream after HOLD_AT tokens (its debug fault plan), so the router
is stopped at a known point, with no sleeps."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from decode_worker.faults import DecodeFaultPlan
from decode_worker.role import DecodeConfig, DecodeRole
from pdserve.client import AsyncPdserveClient, PdserveClient
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.sequence import SamplingParams
from pdserve.worker.server import WorkerConfig, WorkerServer
from protos.pdserve.v1 import generation_pb2 as pb
from tests.conftest import make_engine
from tests.helpers.cluster import running_cluster, start_router
from tests.helpers.workers import wait_until_clean

HOLD_AT, MAX_TOKENS, SEED = 4, 12, 5
PROMPT = list(range(300, 340))


def holding_decode_worker(loaded) -> WorkerServer:
    role = DecodeRole(DecodeConfig(fault_plan=DecodeFaultPlan(hold_after_tokens=HOLD_AT)))
    engine = EngineConfig(cache=CacheConfig(num_blocks=128), device="cpu")
    return WorkerServer(WorkerConfig("decode", engine, worker_id="decode-holding"), role, loaded)


def test_a_stream_whose_router_dies_is_resumed_through_another_token_for_token(tiny_loaded):
    sampling = SamplingParams(temperature=0.8, seed=SEED, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = make_engine(tiny_loaded).generate([PROMPT], sampling, detokenize=False)[0].token_ids
    decode = holding_decode_worker(tiny_loaded)
    with running_cluster(tiny_loaded, workers=[WorkerConfig("prefill"), decode]) as cluster:
        other = start_router(tiny_loaded, cluster.records)
        routers = [cluster.router, other]
        try:
            with PdserveClient(f"{cluster.router.address},{other.address}", timeout_s=60) as client:
                stream = client.stream(token_ids=PROMPT, temperature=0.8, seed=SEED, max_tokens=MAX_TOKENS,
                                       ignore_eos=True)
                got: list[int] = []
                responses = iter(stream)
                while len(got) < HOLD_AT:
                    got.extend(next(responses).token_ids)
                dying = next(r for r in routers if r.servicer.requests_in_flight == 1)
                threading.Thread(target=dying.stop, daemon=True).start()
                decode.role.hold.wait_held(1, timeout_s=30)
                decode.role.hold.release()  # the resumed stream is not held again
                for response in responses:
                    got.extend(response.token_ids)
                assert stream.resumes == 1
                assert got == expected
            wait_until_clean(*cluster.workers, timeout_s=10)
        finally:
            other.stop()


def test_the_async_client_resumes_a_stream_whose_router_dies_token_for_token(tiny_loaded):
    sampling = SamplingParams(temperature=0.8, seed=SEED, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = make_engine(tiny_loaded).generate([PROMPT], sampling, detokenize=False)[0].token_ids
    decode = holding_decode_worker(tiny_loaded)

    async def run(targets: str, routers: list) -> tuple[list[int], int]:
        async with AsyncPdserveClient(targets, timeout_s=60) as client:
            stream = client.stream(token_ids=PROMPT, temperature=0.8, seed=SEED, max_tokens=MAX_TOKENS,
                                   ignore_eos=True)
            got: list[int] = []
            async for response in stream:
                got.extend(response.token_ids)
                if len(got) == HOLD_AT:
                    dying = next(r for r in routers if r.servicer.requests_in_flight == 1)
                    threading.Thread(target=dying.stop, daemon=True).start()
                    await asyncio.to_thread(decode.role.hold.wait_held, 1, 30)
                    decode.role.hold.release()
            return got, stream.resumes

    with running_cluster(tiny_loaded, workers=[WorkerConfig("prefill"), decode]) as cluster:
        other = start_router(tiny_loaded, cluster.records)
        try:
            targets = f"{cluster.router.address},{other.address}"
            got, resumes = asyncio.run(run(targets, [cluster.router, other]))
            assert resumes == 1
            assert got == expected
            wait_until_clean(*cluster.workers, timeout_s=10)
        finally:
            other.stop()


def test_a_continuation_as_long_as_max_tokens_is_refused_naming_both(tiny_loaded):
    with running_cluster(tiny_loaded) as cluster:
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), continuation=pb.TokenIds(ids=[1, 2]),
                                     sampling=pb.SamplingParams(max_tokens=2, temperature=0))
        with pytest.raises(grpc.RpcError) as err:
            list(cluster.stub.Generate(request, timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "continuation has 2 tokens and max_tokens is 2" in err.value.details()
        wait_until_clean(*cluster.workers)
