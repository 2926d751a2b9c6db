"""A router and its workers in this process, over real gRPC sockets (tiny model): the one in-process
cluster every router, front-door, security and fault test builds.

The worker list is handed to the router directly, as the registry's WorkerInfo records (the Redis
registry itself is exercised by tests/worker/redis_cluster.py and the Ray cluster tests); everything
else is the product path.

    running_cluster   start workers and a router; stop them all on the way out
    start_router      a router over records the test gives (workers it started itself, one in
                      another process, one that is not there)
    generate          one Generate call through a router, its replies as a list
"""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace

import grpc

from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.weights import LoadedModel
from pdserve.index.registry import WorkerInfo
from pdserve.worker.server import WorkerConfig, WorkerServer
from protos.pdserve.v1 import generation_pb2, generation_pb2_grpc
from router.config import PlacementConfig, RequestDeadlines
from router.limits import RequestLimits
from router.server import RouterConfig, RouterServer
from tests.helpers.workers import worker_info, worker_server

TINY_CONTEXT = 512  # the tiny model's max_position_embeddings
DEFAULT_WORKERS = (WorkerConfig("prefill"), WorkerConfig("decode"))


@dataclass
class Cluster:
    """router: started over `records` (the list itself: add or remove a record, then
    router.directory.refresh()); workers: in the order asked for; stub: Generation on the router."""

    router: RouterServer
    workers: list[WorkerServer]
    records: list[WorkerInfo]
    channel: grpc.Channel = field(init=False)

    def __post_init__(self) -> None:
        self.channel = grpc.insecure_channel(self.router.address)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)

    @property
    def prefill(self) -> WorkerServer:
        return next(w for w in self.workers if w.config.role == "prefill")

    @property
    def decode(self) -> WorkerServer:
        return next(w for w in self.workers if w.config.role == "decode")


def start_router(loaded: LoadedModel, records: Sequence[WorkerInfo], *, routing: str = "least_load",
                 limits: RequestLimits | None = None, deadlines: RequestDeadlines | None = None,
                 metrics_port: int | None = None, **router_options) -> RouterServer:
    """A started router over `records` (read again at every directory refresh). Remote prefill from
    32 uncached tokens; the tiny model's context. router_options: other RouterConfig fields
    (security, connections, cache_isolation, ...)."""
    placement = PlacementConfig(routing=routing, min_remote_prefill_tokens=32)
    limits = replace(limits or RequestLimits(), max_context_tokens=TINY_CONTEXT)
    config = RouterConfig(port=0, placement=placement, limits=limits, metrics_port=metrics_port,
                          deadlines=deadlines or RequestDeadlines(), **router_options)
    router = RouterServer(config, loaded.tokenizer, lambda: list(records), rng=random.Random(0))
    router.start()
    return router


@contextmanager
def running_cluster(loaded: LoadedModel, limits: RequestLimits | None = None, *,
                    workers: Sequence[WorkerConfig | WorkerServer] = DEFAULT_WORKERS, num_blocks: int = 128,
                    routing: str = "least_load", deadlines: RequestDeadlines | None = None,
                    metrics_port: int | None = None, **router_options) -> Iterator[Cluster]:
    """Start the workers, then a router over them (start_router's arguments); stop all on the way out.
    workers: a WorkerConfig is served with the tiny engine of num_blocks and its role's defaults; a
    WorkerServer (a role built with a fault plan, say) is taken as built. Default: one prefill and one
    decode worker."""
    engine = EngineConfig(cache=CacheConfig(num_blocks=num_blocks), device="cpu")
    servers = [w if isinstance(w, WorkerServer) else worker_server(replace(w, engine=engine), loaded)
               for w in workers]
    with ExitStack() as stack:
        for server in servers:
            server.start()
            stack.callback(server.stop)
        records = [worker_info(s) for s in servers]
        router = start_router(loaded, records, routing=routing, limits=limits, deadlines=deadlines,
                              metrics_port=metrics_port, **router_options)
        stack.callback(router.stop)
        cluster = Cluster(router, servers, records)
        stack.callback(cluster.channel.close)
        yield cluster


# --- requests ---------------------------------------------------------------------------------------
def greedy(max_tokens: int = 8) -> generation_pb2.SamplingParams:
    return generation_pb2.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def generate_request(prompt: list[int], max_tokens: int = 8,
                     request_id: str = "") -> generation_pb2.GenerateRequest:
    """A greedy request over token ids (ignore_eos: always max_tokens tokens)."""
    return generation_pb2.GenerateRequest(request_id=request_id, sampling=greedy(max_tokens),
                                          token_ids=generation_pb2.TokenIds(ids=prompt))


def generate(router: RouterServer, request: generation_pb2.GenerateRequest,
             timeout: float = 60) -> list[generation_pb2.GenerateResponse]:
    """One Generate call on a channel of its own: every reply; grpc.RpcError when it fails."""
    with grpc.insecure_channel(router.address) as channel:
        return list(generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=timeout))


# --- what a test checks beside the leak check (tests/helpers/workers.py wait_until_clean) -----------
def metric_value(samples: Mapping[tuple[str, tuple], float], name: str, **labels: str) -> float:
    """One sample of a scrape (pdserve.metrics.scrape): 0 when the series was never written."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def dead_engine_loops(cluster: Cluster) -> list[str]:
    """Workers whose engine-loop thread has died (an exception in a step): they hang every request."""
    return [w.config.worker_id for w in cluster.workers if not w.loop._thread.is_alive()]


@dataclass(frozen=True)
class ProcessResources:
    threads: int
    open_fds: int
    rss_mib: float

    @classmethod
    def now(cls) -> ProcessResources:
        with open("/proc/self/status") as f:
            rss_kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        return cls(threading.active_count(), len(os.listdir("/proc/self/fd")), rss_kib / 1024)

