"""bench.worker_memory's budget: the default cluster's weights once, its KV pool, and the allowance."""

import pytest

from bench.worker_memory import RUNTIME_ALLOWANCE_BYTES, Budget, budget_of, parse_args, report
from deploy.config import ClusterSpec
from pdserve.engine.config import CacheConfig, EngineConfig


def test_the_budget_is_weights_times_1_3_plus_the_pool_plus_the_allowance():
    assert Budget(weight_bytes=1000, kv_pool_bytes=50).total == 1300 + 50 + RUNTIME_ALLOWANCE_BYTES


def test_smollm2s_budget_counts_its_weights_once_and_the_pool_in_whole_blocks():
    budget = budget_of(ClusterSpec(engine=EngineConfig(cache=CacheConfig(kv_cache_gib=1.0))))
    assert budget.weight_bytes == 538_060_032  # pdserve plan's figure for SmolLM2-135M, float32
    block_bytes = 16 * 2 * 30 * 3 * 64 * 4  # block_size x K,V x layers x kv_heads x head_dim x float32
    assert budget.kv_pool_bytes == (2**30 // block_bytes) * block_bytes


def test_the_report_gives_each_worker_against_the_budget():
    r = {"budget_bytes": 2 * 2**30, "weight_bytes": 2**29, "kv_pool_bytes": 2**30,
         "rss_bytes": {"after_load": {"DecodeWorker:7": 2**30}, "after_requests": {"DecodeWorker:7": 2**30}}}
    assert "DecodeWorker:7" in report(r) and "0.500 of budget" in report(r)


def test_a_negative_request_count_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--requests", "-1"])
    assert "--requests must be >= 0" in capsys.readouterr().err
