"""Cluster fixtures: one local Ray for the session, real embedded Redis, real actors.

Each cluster gets its own Redis and its own actor names; they share the Ray instance,
which starts once (ray.init costs seconds on a small machine).
"""

from __future__ import annotations

import time
import uuid

import grpc
import pytest

from deploy.launcher import ClusterSpec, LocalCluster
from pdserve.client import PdserveClient
from pdserve.engine.config import CacheConfig
from protos.pdserve.v1 import worker_pb2, worker_pb2_grpc
from router.config import PlacementConfig
from tests.kv_audit import audit_failures  # noqa: F401  (the cluster tests' end-of-test check)


@pytest.fixture(scope="session")
def ray_session():
    import ray

    # NOTE: address="local" always starts a fresh instance; without it, ray.init joins a cluster
    # another process started with `ray start` on this machine (the two-node test makes one).
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False,
             object_store_memory=256 << 20, namespace="pdserve-tests")
    yield
    ray.shutdown()


def start_cluster(num_prefill: int, num_decode: int, num_blocks: int = 512, routing: str = "prefix",
                  **overrides) -> LocalCluster:
    spec = ClusterSpec(num_prefill=num_prefill, num_decode=num_decode, port=0,
                       namespace=f"t{uuid.uuid4().hex[:6]}", cache=CacheConfig(num_blocks=num_blocks),
                       placement=PlacementConfig(routing=routing), **overrides)
    cluster = LocalCluster(spec, say=lambda *_: None)
    cluster.start()
    return cluster


@pytest.fixture(scope="module")
def cluster_1p1d(ray_session):
    cluster = start_cluster(1, 1, num_blocks=96)  # small pools, so a test can force eviction
    yield cluster
    cluster.stop()


def client_of(cluster: LocalCluster) -> PdserveClient:
    return PdserveClient(cluster.router.address, timeout_s=300)


def worker_status(cluster: LocalCluster) -> dict[str, worker_pb2.WorkerStatus]:
    out = {}
    for info in cluster.registry.live_workers():
        stub = worker_pb2_grpc.WorkerStub(grpc.insecure_channel(info.address))
        out[info.worker_id] = stub.Status(worker_pb2.StatusRequest(), timeout=10)
    return out


def wait_until_clean(cluster: LocalCluster, timeout_s: float = 10.0) -> dict[str, worker_pb2.WorkerStatus]:
    """Poll every worker until no block is referenced, nothing is parked or held."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = worker_status(cluster)
        dirty = {w: s for w, s in status.items()
                 if s.used_blocks or s.parked_transfers or s.held_blocks or s.active_requests}
        if not dirty or time.monotonic() > deadline:
            return dirty
        time.sleep(0.05)


def worker_addresses(cluster: LocalCluster) -> list[str]:
    """Every live worker's address (a restarted worker's new one)."""
    return [info.address for info in cluster.registry.live_workers()]
