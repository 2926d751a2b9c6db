"""How many KV blocks a worker's pool holds (CacheConfig.resolve_num_blocks): num_blocks, else
kv_cache_gib, else on a GPU vLLM's rule over its free and total memory (gpu_pool_blocks, pure, so
tested here without one), else 1 GiB on the CPU."""

from __future__ import annotations

import pytest

from pdserve.engine.config import (
    ACTIVATION_SLACK_BYTES,
    CPU_KV_CACHE_GIB,
    CacheConfig,
    DeviceMemory,
    ModelConfig,
    activation_reserve_bytes,
    gpu_pool_blocks,
)
from pdserve.field_error import FieldError

GIB = 2**30
# SmolLM2-135M's shape: 30 layers x 3 KV heads x head_dim 64
SMOLLM2 = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                      num_kv_heads=3, head_dim=64, max_position_embeddings=8192)


def test_the_gpu_rule_is_utilization_of_the_total_less_what_is_used_and_the_reserve():
    # 80 GiB GPU, 10 GiB in use: 72 - 10 - 2 = 60 GiB of 1 MiB blocks
    assert gpu_pool_blocks(70 * GIB, 80 * GIB, 0.9, 2**20, 2 * GIB) == 60 * 1024
    # another process's memory comes off the worker's share too, as vLLM counts it
    assert gpu_pool_blocks(50 * GIB, 80 * GIB, 0.9, 2**20, 2 * GIB) == 40 * 1024
    # whole blocks only
    assert gpu_pool_blocks(80 * GIB, 80 * GIB, 1.0, 3 * GIB, 0) == 26


def test_the_gpu_rule_refuses_a_pool_under_one_block_naming_the_setting():
    with pytest.raises(ValueError, match=r"raise cache.gpu_memory_utilization \(--gpu-memory-utilization\)"):
        gpu_pool_blocks(8 * GIB, 80 * GIB, 0.9, 2**20, GIB)  # 72 GiB in use already: nothing left


def test_a_cpu_pool_is_unchanged_1_gib_by_default():
    cache = CacheConfig(kv_dtype="float32")
    block_bytes = SMOLLM2.kv_bytes_per_token("float32") * 16
    assert cache.resolve_num_blocks(SMOLLM2) == int(CPU_KV_CACHE_GIB * GIB) // block_bytes == 1456
    assert CacheConfig(kv_dtype="float32", kv_cache_gib=2.0).resolve_num_blocks(SMOLLM2) == 2 * 1456


def test_on_a_gpu_the_rule_applies_only_when_neither_blocks_nor_gib_is_given():
    gpu = DeviceMemory(free_bytes=70 * GIB, total_bytes=80 * GIB)
    def blocks(**cache: object) -> int:
        return CacheConfig(kv_dtype="bfloat16", **cache).resolve_num_blocks(SMOLLM2, gpu, GIB)

    block_bytes = CacheConfig(kv_dtype="bfloat16").block_bytes(SMOLLM2)
    assert blocks() == (int(80 * GIB * 0.9) - 10 * GIB - GIB) // block_bytes
    assert blocks(gpu_memory_utilization=0.5) == (40 * GIB - 10 * GIB - GIB) // block_bytes
    assert blocks(num_blocks=7) == 7
    assert blocks(kv_cache_gib=1.0) == GIB // block_bytes


def test_the_activation_reserve_is_one_steps_activations_and_the_slack():
    per_token = 3 * 576 + (9 + 2 * 3) * 64 + 3 * 1536
    expected = 2048 * per_token * 2 + 64 * 49152 * (2 + 4) + ACTIVATION_SLACK_BYTES
    assert activation_reserve_bytes(SMOLLM2, 2048, 64, "bfloat16") == expected
    assert activation_reserve_bytes(SMOLLM2, 2048, 64, "float32") > expected


def test_an_unresolved_kv_dtype_cannot_size_a_pool():
    with pytest.raises(ValueError, match="auto is the model's dtype, resolved first"):
        CacheConfig().resolve_num_blocks(SMOLLM2)


@pytest.mark.parametrize("value", [0, 1.01, -0.5])
def test_gpu_memory_utilization_is_a_fraction(value):
    with pytest.raises(FieldError, match=r"must be in \(0, 1\]"):
        CacheConfig(gpu_memory_utilization=value)
