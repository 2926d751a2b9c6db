"""One worker = one GPU: gpus_per_worker's default from the Ray cluster's GPUs (deploy/config.py
workers_gpus, pure), the values a spec refuses, and the device the launcher gives a worker's engine."""

from __future__ import annotations

import pytest

from deploy.config import ClusterSpec, workers_gpus
from deploy.launcher import LocalCluster


@pytest.mark.parametrize(("requested", "cluster_gpus", "workers", "gpus"), [
    (None, 0, 2, 0),  # no GPU anywhere: CPU workers
    (None, 2, 2, 1),  # a GPU for every worker
    (None, 8, 2, 1),  # more than enough: still one each
    (0, 8, 2, 0),  # 0 forces the CPU
    (1, 0, 2, 1),  # 1 on a cluster without GPUs yet (an autoscaler adds them): kept
    (1.0, 4, 4, 1),
])
def test_each_worker_gets_one_gpu_or_none(requested, cluster_gpus, workers, gpus):
    assert workers_gpus(requested, cluster_gpus, workers) == gpus


def test_gpus_for_only_some_workers_are_refused_with_the_ways_out():
    with pytest.raises(ValueError, match=r"has 1 GPUs for 2 workers, and each worker takes one GPU") as error:
        workers_gpus(None, 1, 2)
    assert "gpus_per_worker (--gpus-per-worker) 0" in str(error.value)


@pytest.mark.parametrize("value", [0.5, 2, 1.5, -1])
def test_a_fractional_or_larger_gpu_count_is_refused(value):
    with pytest.raises(ValueError, match=r"must be 0 \(CPU\) or 1: one worker = one GPU"):
        ClusterSpec(gpus_per_worker=value)


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_the_launcher_gives_a_gpu_workers_engine_the_device_cuda(device):
    cluster = LocalCluster(ClusterSpec(namespace="t-gpu"))
    spec = cluster._worker_spec("decode", "decode-0", threads=None, device=device)
    assert spec.engine.device == device
    assert spec.engine.dtype == "auto" and spec.engine.cache.kv_dtype == "auto"  # each engine resolves them
