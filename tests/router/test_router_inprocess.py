"""Router + two real workers in one process over real gRPC sockets (tiny model).

The worker list is given directly here (the Redis registry is exercised by the cluster
tests); everything else is the product path.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import grpc
import pytest

from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.sequence import SamplingParams
from pdserve.worker.server import WorkerConfig
from protos.pdserve.v1 import generation_pb2, generation_pb2_grpc
from router.config import PlacementConfig
from router.server import RouterConfig, RouterServer
from tests.conftest import make_engine
from tests.workers import worker_server


@dataclass(frozen=True)
class Record:
    worker_id: str
    role: str
    address: str
    epoch: int = 0


@pytest.fixture(scope="module")
def cluster(tiny_loaded):
    engine = EngineConfig(cache=CacheConfig(num_blocks=128), device="cpu")
    workers = [worker_server(WorkerConfig(role, engine), tiny_loaded) for role in ("prefill", "decode")]
    records = [Record(w.config.worker_id, w.config.role, w.start()) for w in workers]
    placement = PlacementConfig(routing="least_load", min_remote_prefill_tokens=32)
    config = RouterConfig(port=0, placement=placement)
    router = RouterServer(config, tiny_loaded.tokenizer, lambda: records, rng=random.Random(0))
    router.start()
    yield router, workers
    router.stop()
    for w in workers:
        w.stop()


def generate(router, **kwargs):
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(router.address))
    return list(stub.Generate(generation_pb2.GenerateRequest(**kwargs), timeout=60))


def greedy(max_tokens=8):
    return generation_pb2.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


@pytest.mark.parametrize("prompt_len, remote", [(50, True), (10, False)])
def test_both_paths_match_one_engine(cluster, tiny_loaded, prompt_len, remote):
    router, workers = cluster
    prompt = list(range(700, 700 + prompt_len))
    replies = generate(router, token_ids=generation_pb2.TokenIds(ids=prompt), sampling=greedy())
    tokens = [t for r in replies for t in r.token_ids]
    expected = make_engine(tiny_loaded).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), detokenize=False)[0]
    assert tokens == expected.token_ids
    last = replies[-1]
    assert last.finished and last.usage.completion_tokens == 8 and last.usage.prompt_tokens == prompt_len
    assert bool(last.prefill_worker) is remote
    for w in workers:
        status = w.status()
        assert status.used_blocks == 0 and status.parked_transfers == 0


def test_bad_requests_are_invalid_argument(cluster):
    router, _ = cluster
    cases = [
        ({}, "prompt is missing"),
        ({"token_ids": generation_pb2.TokenIds(ids=[])}, "prompt is empty"),
        ({"token_ids": generation_pb2.TokenIds(ids=[1, 10**6])}, "outside the vocabulary"),
        ({"text": "hi", "sampling": generation_pb2.SamplingParams(max_tokens=0)}, "max_tokens must be >= 1"),
        ({"text": "hi", "sampling": generation_pb2.SamplingParams(top_p=1.5)}, "top_p"),
        ({"text": "hi", "sampling": generation_pb2.SamplingParams(temperature=-1)}, "temperature"),
        ({"chat": generation_pb2.ChatMessages(messages=[generation_pb2.ChatMessage(role="x")])}, "role"),
    ]
    for kwargs, message in cases:
        with pytest.raises(grpc.RpcError) as err:
            generate(router, **kwargs)
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT, kwargs
        assert message in err.value.details()
