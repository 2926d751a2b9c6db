"""A router + one prefill and one decode worker in this process, over real gRPC sockets (tiny model).

The worker list is given directly, as the registry's WorkerInfo records (the Redis registry
itself is exercised by the cluster tests); everything else is the product path.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import grpc

from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.weights import LoadedModel
from pdserve.index.registry import WorkerInfo
from pdserve.worker.server import WorkerConfig, WorkerServer
from protos.pdserve.v1 import generation_pb2, generation_pb2_grpc
from router.config import PlacementConfig
from router.limits import RequestLimits
from router.server import RouterConfig, RouterServer
from tests.workers import worker_server

TINY_CONTEXT = 512  # the tiny model's max_position_embeddings


@dataclass
class Cluster:
    router: RouterServer
    workers: list[WorkerServer]
    channel: grpc.Channel = field(init=False)

    def __post_init__(self) -> None:
        self.channel = grpc.insecure_channel(self.router.address)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)


@contextmanager
def running_cluster(loaded: LoadedModel, limits: RequestLimits | None = None, num_blocks: int = 128,
                    routing: str = "least_load", metrics_port: int | None = None,
                    router_options: Mapping[str, Any] | None = None,
                    worker_configs: tuple[WorkerConfig, ...] | None = None) -> Iterator[Cluster]:
    """router_options: RouterConfig fields to set; worker_configs: the workers (their engine is replaced by
    the tiny one), default one prefill and one decode worker."""
    engine = EngineConfig(cache=CacheConfig(num_blocks=num_blocks), device="cpu")
    configs = worker_configs or (WorkerConfig("prefill"), WorkerConfig("decode"))
    workers = [worker_server(replace(c, engine=engine), loaded) for c in configs]
    records = [info(w, w.start()) for w in workers]
    placement = PlacementConfig(routing=routing, min_remote_prefill_tokens=32)
    limits = replace(limits or RequestLimits(), max_context_tokens=TINY_CONTEXT)
    config = RouterConfig(port=0, placement=placement, limits=limits,
                          metrics_port=metrics_port, **(router_options or {}))
    router = RouterServer(config, loaded.tokenizer, lambda: records, rng=random.Random(0))
    router.start()
    cluster = Cluster(router, workers)
    try:
        yield cluster
    finally:
        cluster.channel.close()
        router.stop()
        for w in workers:
            w.stop()


def info(worker: WorkerServer, address: str) -> WorkerInfo:
    c = worker.config
    return WorkerInfo.of_engine(worker.engine, c.worker_id, c.role, address, "local", 0)


def greedy(max_tokens: int = 8) -> generation_pb2.SamplingParams:
    return generation_pb2.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def wait_until_clean(cluster: Cluster, timeout_s: float = 10.0) -> None:
    """Every block back in the free pool on both workers (the prefill worker lets go of its held
    blocks just after it replies, so this waits a moment)."""
    deadline = time.monotonic() + timeout_s
    while True:
        statuses = [w.status() for w in cluster.workers]
        if all(s.used_blocks == 0 and s.parked_transfers == 0 and s.held_blocks == 0
               and s.free_blocks == s.num_blocks for s in statuses):
            return
        if time.monotonic() >= deadline:
            raise AssertionError(f"workers not clean after {timeout_s} s: {statuses}")
        time.sleep(0.05)


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
