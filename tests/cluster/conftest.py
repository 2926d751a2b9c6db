"""Cluster fixtures: one local Ray for the session, real embedded Redis, real actors (the helpers:
tests/helpers/ray_cluster.py). Every test in this folder is marked slow (tests/conftest.py).

Each cluster gets its own Redis and its own actor names; they share the Ray instance,
which starts once (ray.init costs seconds on a small machine).
"""

from __future__ import annotations

import pytest

from tests.helpers.ray_cluster import start_cluster


@pytest.fixture(scope="session")
def ray_session():
    import ray

    # NOTE: address="local" always starts a fresh instance; without it, ray.init joins a cluster
    # another process started with `ray start` on this machine (the two-node test makes one).
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False,
             object_store_memory=256 << 20, namespace="pdserve-tests")
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def cluster_1p1d(ray_session):
    cluster = start_cluster(1, 1, num_blocks=96)  # small pools, so a test can force eviction
    yield cluster
    cluster.stop()
