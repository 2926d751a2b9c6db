"""Clusters of real Ray actors (deploy.launcher.LocalCluster, embedded Redis) and what the cluster tests
ask of them. The session's Ray instance is the `ray_session` fixture (tests/cluster/conftest.py); each
cluster gets its own Redis and its own actor names on it.
"""

from __future__ import annotations

import uuid

import grpc

from deploy.launcher import ClusterSpec, LocalCluster
from pdserve.client import PdserveClient
from pdserve.engine.config import CacheConfig, EngineConfig
from protos.pdserve.v1 import worker_pb2, worker_pb2_grpc
from router.config import PlacementConfig
from tests.helpers.waiting import until_clean
from tests.helpers.workers import leftovers


def start_cluster(num_prefill: int, num_decode: int, num_blocks: int = 512, routing: str = "prefix",
                  model: str | None = None, **overrides) -> LocalCluster:
    """A started cluster on the session's Ray: num_blocks a worker (or a whole `cache` config), `routing`,
    `model` (a path or a name; None: SmolLM2), other ClusterSpec fields."""
    overrides.setdefault("http_port", 0)  # off unless a test asks: many clusters, one port 8000
    cache = overrides.pop("cache", CacheConfig(num_blocks=num_blocks))
    engine = EngineConfig(model_path=model, cache=cache)
    spec = ClusterSpec(num_prefill=num_prefill, num_decode=num_decode, port=0,
                       namespace=f"t{uuid.uuid4().hex[:6]}", engine=engine,
                       placement=PlacementConfig(routing=routing), **overrides)
    cluster = LocalCluster(spec, say=lambda *_: None)
    cluster.start()
    return cluster


def client_of(cluster: LocalCluster) -> PdserveClient:
    return PdserveClient(cluster.router.address, timeout_s=300)


def worker_status(cluster: LocalCluster) -> dict[str, worker_pb2.WorkerStatus]:
    """Every live worker's Status, by worker id."""
    out = {}
    for info in cluster.registry.live_workers():
        with grpc.insecure_channel(info.address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            out[info.worker_id] = stub.Status(worker_pb2.StatusRequest(), timeout=10)
    return out


def worker_addresses(cluster: LocalCluster) -> list[str]:
    """Every live worker's address (a restarted worker's new one)."""
    return [info.address for info in cluster.registry.live_workers()]


def wait_until_cluster_clean(cluster: LocalCluster, timeout_s: float = 10.0) -> None:
    """wait_until_clean (tests/helpers/workers.py) for a cluster's workers, through Status alone: every
    live one (the registry read again each time: a restarted worker's new incarnation)."""
    until_clean(lambda: {w: left for w, s in worker_status(cluster).items() if (left := leftovers(s))},
                timeout_s, poll_s=0.05)
