"""The disk KV tier across a crash: a decode worker killed with a long shared prefix on its disk
tier comes back (Ray restarts it under a new epoch) warm, and serves that prefix from disk, exactly.

Real Ray, real Redis, real gRPC, SmolLM2; the decode worker prefills its own prompts (no prefill
worker). Its pool is small and its host tier 2 blocks, so the prefix reaches disk quickly.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from pdserve.engine.config import CacheConfig
from tests.cluster.test_worker_faults import describe, wait_for_epoch
from tests.helpers.ray_cluster import client_of, start_cluster, wait_until_cluster_clean, worker_status

PREFIX_TOKENS = 320  # 20 blocks of 16


@pytest.fixture
def cluster_with_disk_tier(ray_session, tmp_path):
    cache = CacheConfig(num_blocks=48, host_num_blocks=2, disk_cache_dir=str(tmp_path / "kv"))
    cluster = start_cluster(0, 1, cache=cache)
    yield cluster
    cluster.stop()


def test_a_killed_decode_worker_comes_back_warm_from_its_disk_tier_with_exact_tokens(cluster_with_disk_tier):
    cluster = cluster_with_disk_tier
    g = torch.Generator().manual_seed(18)
    rand = lambda n: torch.randint(0, 49152, (n,), generator=g).tolist()  # noqa: E731
    prefix = rand(PREFIX_TOKENS)
    prompt = prefix + rand(9)
    with client_of(cluster) as client:
        first = client.generate(token_ids=prompt, temperature=0, max_tokens=8, ignore_eos=True)
        for _ in range(3):  # 3 x 40 blocks through a 48-block pool and 2 host slots: the prefix goes to disk
            client.generate(token_ids=rand(630), temperature=0, max_tokens=1)
    (status,) = worker_status(cluster).values()
    assert status.disk_used_blocks >= PREFIX_TOKENS // 16, status
    victim = first.decode_worker
    before = describe(cluster, victim)
    os.kill(before["pid"], signal.SIGKILL)
    # asked while Ray restarts it (loading the model takes seconds): answered by the new process
    restarted = describe(cluster, victim)
    assert restarted["pid"] != before["pid"] and restarted["epoch"] > before["epoch"]
    after = wait_for_epoch(cluster, victim, above=before["epoch"])
    assert after["pid"] == restarted["pid"]
    (status,) = worker_status(cluster).values()
    assert status.disk_used_blocks >= PREFIX_TOKENS // 16  # found its files again
    with client_of(cluster) as client:
        again = client.generate(token_ids=prompt, temperature=0, max_tokens=8, ignore_eos=True)
    assert again.usage["cached_tokens"] >= PREFIX_TOKENS
    assert again.usage["disk_cached_tokens"] >= PREFIX_TOKENS - 2 * 16  # (two blocks may come from host)
    assert again.token_ids == first.token_ids
    wait_until_cluster_clean(cluster)
