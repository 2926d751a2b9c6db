"""A cluster in this process over a real redis-server: WorkerActors (the production actor body, no Ray)
and a router built by router.redis_backend.redis_router, all over real gRPC sockets (tiny model).

The fault tests put the redis-server into a bad state (out of memory, read-only replica, revoked ACL
user, SIGSTOPped) and check that requests stay exact, that no engine step waits on Redis (from the
workers' pdserve_worker_step_seconds histograms), and that prefix routing comes back with Redis.
"""

from __future__ import annotations

import concurrent.futures as cf
import random
import signal
import threading
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import grpc

from decode_worker.actor import DecodeWorker
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.hashing import hash_blocks
from pdserve.engine.sequence import SamplingParams
from pdserve.engine.weights import LoadedModel
from pdserve.index.base import StoreUnavailable
from pdserve.worker.actor import WorkerActor, WorkerSpec
from pdserve.worker.server import WorkerServer
from protos.pdserve.v1 import generation_pb2, generation_pb2_grpc
from router.config import PlacementConfig
from router.limits import RequestLimits
from router.redis_backend import redis_router
from router.server import RouterConfig, RouterServer
from tests.conftest import MIN_GREEDY_MARGIN, greedy_margin, make_engine
from tests.helpers.waiting import eventually

TINY_CONTEXT = 512
HEARTBEAT_S = 0.25
LEASE_TTL_S = 1.5  # short, so a fault held a few seconds outlives every lease
MAX_TOKENS = 8


def decode_spec(worker_id: str, redis_url: str, model_dir: str, namespace: str, num_blocks: int = 96,
                **overrides) -> WorkerSpec:
    engine = EngineConfig(model_dir, CacheConfig(num_blocks=num_blocks), num_threads=1)
    values = dict(role="decode", worker_id=worker_id, redis_url=redis_url, engine=engine, metrics_port=None,
                  namespace=namespace, heartbeat_s=HEARTBEAT_S, liveness_ttl_s=LEASE_TTL_S, redis_wait_s=10.0)
    return WorkerSpec(**(values | overrides))


@contextmanager
def sigterm_kept() -> Iterator[None]:
    """WorkerActor installs a SIGTERM handler on the main thread (a worker process drains on SIGTERM);
    give pytest its own back afterwards."""
    before = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


@dataclass(frozen=True)
class StepTimes:
    """Sum, count and the count at or below BOUND_S of the workers' step histograms, at one moment."""

    total_s: float
    steps: int
    steps_within_bound: int

    # A histogram bucket bound; a step that waited on a Redis call takes >= 1 s (the socket timeout).
    # NOTE: 0.6, not lower: on a loaded 2-core machine a tiny-model step can stall past 0.25 s now
    # and then for reasons of its own (seen once in a full-suite run), and that is not a Redis wait.
    BOUND_S = 0.6

    @classmethod
    def of(cls, workers: Sequence[WorkerActor]) -> StepTimes:
        total = steps = within = 0.0
        for w in workers:
            registry = w.server.metrics.registry
            total += registry.get_sample_value("pdserve_worker_step_seconds_sum") or 0.0
            steps += registry.get_sample_value("pdserve_worker_step_seconds_count") or 0.0
            within += registry.get_sample_value("pdserve_worker_step_seconds_bucket",
                                                {"le": str(cls.BOUND_S)}) or 0.0
        return cls(total, int(steps), int(within))

    def since(self, before: StepTimes) -> StepTimes:
        return StepTimes(self.total_s - before.total_s, self.steps - before.steps,
                         self.steps_within_bound - before.steps_within_bound)

    @property
    def mean_s(self) -> float:
        return self.total_s / self.steps if self.steps else 0.0

    @property
    def slow_steps(self) -> int:
        return self.steps - self.steps_within_bound


class RedisCluster:
    """Decode workers and a prefix-routing router over one Redis URL (which may name an ACL user)."""

    def __init__(self, loaded: LoadedModel, model_dir: str, redis_url: str, num_decode: int = 2) -> None:
        self.loaded = loaded
        self.namespace = f"t{uuid.uuid4().hex[:8]}"
        self.redis_url = redis_url
        self.model_dir = model_dir
        self.workers: list[WorkerActor] = []
        self.router: RouterServer | None = None
        self._reference = make_engine(loaded, prefix_caching=False)
        self._expected: dict[tuple[int, ...], list[int]] = {}
        self._reference_lock = threading.Lock()
        self._channel: grpc.Channel | None = None
        for i in range(num_decode):
            self.add_worker(f"decode-{i}")

    def add_worker(self, worker_id: str, **overrides) -> WorkerActor:
        spec = decode_spec(worker_id, self.redis_url, self.model_dir, self.namespace, **overrides)
        actor = DecodeWorker(spec)
        self.workers.append(actor)
        return actor

    def start_router(self) -> RouterServer:
        config = RouterConfig(port=0, refresh_s=0.1, metrics_port=None,
                              placement=PlacementConfig(routing="prefix"),
                              limits=RequestLimits(max_context_tokens=TINY_CONTEXT))
        self.router = redis_router(config, self.loaded.tokenizer, self.redis_url, self.namespace,
                                   rng=random.Random(0))
        self.router.start()
        self._channel = grpc.insecure_channel(self.router.address)
        eventually(lambda: self.routed_ids() == {w.spec.worker_id for w in self.workers}, 10,
                 "the router sees every worker")
        return self.router

    @property
    def servers(self) -> list[WorkerServer]:
        """The workers' WorkerServers (for wait_until_clean: tests/helpers/workers.py)."""
        return [w.server for w in self.workers]

    def routed_ids(self) -> set[str]:
        assert self.router is not None
        return {w.worker_id for w in self.router.directory.workers("decode")}

    def stop(self) -> None:
        if self._channel is not None:
            self._channel.close()
        if self.router is not None:
            self.router.stop()
        for w in self.workers:
            w.stop()

    # --- requests ---------------------------------------------------------------------------------
    def generate(self, prompt: list[int], timeout_s: float = 60.0) -> generation_pb2.GenerateResponse:
        """One greedy request through the router; its last message, checked against the in-process
        engine (AssertionError on any difference or error)."""
        stub = generation_pb2_grpc.GenerationStub(self._channel)
        request = generation_pb2.GenerateRequest(
            token_ids=generation_pb2.TokenIds(ids=prompt),
            sampling=generation_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
        replies = list(stub.Generate(request, timeout=timeout_s))
        tokens = [t for r in replies for t in r.token_ids]
        assert tokens == self.expected(prompt), f"tokens differ from the in-process engine: {tokens}"
        last = replies[-1]
        assert last.finished and last.finish_reason == "length", last
        return last

    def clear_of_near_ties(self, prompt: list[int]) -> bool:
        """Whether prompt's greedy path keeps its top two logits MIN_GREEDY_MARGIN apart, so batching
        cannot flip it (tests/conftest.py)."""
        with self._reference_lock:
            return greedy_margin(self._reference, prompt, MAX_TOKENS) >= MIN_GREEDY_MARGIN

    def expected(self, prompt: list[int]) -> list[int]:
        """What the in-process engine (prefix caching off) generates for prompt."""
        with self._reference_lock:  # one engine, many request threads
            key = tuple(prompt)
            if key not in self._expected:
                sampling = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
                result = self._reference.generate([prompt], sampling, detokenize=False)[0]
                self._expected[key] = result.token_ids
            return self._expected[key]

    def concurrently(self, prompts: Sequence[list[int]]) -> list[generation_pb2.GenerateResponse]:
        """All prompts at once (8 threads); raises the first failure."""
        with cf.ThreadPoolExecutor(len(prompts)) as pool:
            return list(pool.map(self.generate, prompts))

    # --- the index as the router sees it ----------------------------------------------------------
    def hashes(self, prompt: list[int]) -> list[bytes]:
        engine = self.workers[0].server.engine
        return hash_blocks(prompt, engine.block_size, engine.salt)

    def holders(self, prompt: list[int]) -> dict[str, int]:
        """worker_id -> leading blocks of prompt it holds, as the router will route by: its placer's
        match (the index's mirror, pdserve/index/mirror.py); {} while that is unavailable."""
        assert self.router is not None
        try:
            return dict(self.router.placer.match(self.hashes(prompt)))
        except StoreUnavailable:
            return {}
