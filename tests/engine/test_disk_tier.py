"""The disk tier: blocks leaving host memory are files that a restarted engine finds again.

A restart here is a second engine over the same folder (the first dropped without any shutdown,
as a crash leaves it); tests/cluster/test_kv_tiers.py kills a real decode worker.
"""

from __future__ import annotations

import torch

from pdserve.engine.disk_tier import SUFFIX, TEMP_PREFIX
from pdserve.engine.events import Tier, index_key
from pdserve.engine.sequence import SamplingParams
from tests.conftest import assert_no_leaks, make_engine
from tests.engine.test_exactness import reference_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def prompts(vocab: int, n: int, length: int, seed: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(n)]


def spill_to_disk(loaded, folder, shared: list[int]) -> None:
    """Prefill `shared`, then enough other prompts that its blocks go device -> host -> disk."""
    engine = make_engine(loaded, block_size=8, num_blocks=8, host_blocks=4, disk_dir=str(folder))
    engine.generate([shared], GREEDY, detokenize=False)
    for p in prompts(loaded.config.vocab_size, 6, 40, seed=9):
        engine.generate([p], GREEDY, detokenize=False)
    assert_no_leaks(engine)
    disk = engine.pool.lower.disk
    assert disk.usage().used_blocks > 0


def test_a_restarted_engine_over_the_same_folder_comes_back_warm_and_exact(tiny_loaded, tmp_path):
    shared = prompts(tiny_loaded.config.vocab_size, 1, 33)[0]  # 4 full blocks of 8
    spill_to_disk(tiny_loaded, tmp_path, shared)
    again = make_engine(tiny_loaded, block_size=8, num_blocks=8, host_blocks=4, disk_dir=str(tmp_path))
    disk_keys = again.pool.lower.disk.keys()  # what its resync under the new epoch publishes
    assert disk_keys and set(disk_keys) <= set(again.pool.cached_hashes())
    first = again.pool.lower.disk._lru  # noqa: SLF001 (each key is its block's disk-tier key)
    assert disk_keys == [index_key(h, Tier.DISK) for h in first]
    result = again.generate([shared], GREEDY, detokenize=False)[0]
    assert result.usage.disk_cached_tokens > 0
    assert result.usage.cached_tokens >= result.usage.disk_cached_tokens
    assert result.token_ids == reference_greedy(again, shared, 4)[0]
    assert_no_leaks(again)


def test_a_corrupted_file_is_skipped_and_deleted(tiny_loaded, tmp_path):
    shared = prompts(tiny_loaded.config.vocab_size, 1, 33)[0]
    spill_to_disk(tiny_loaded, tmp_path, shared)
    files = sorted(tmp_path.glob(f"*{SUFFIX}"))
    victim = files[0]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF  # one flipped byte of KV
    victim.write_bytes(bytes(data))
    again = make_engine(tiny_loaded, block_size=8, num_blocks=8, host_blocks=4, disk_dir=str(tmp_path))
    disk = again.pool.lower.disk
    assert disk.skipped == 1 and not victim.exists()
    assert disk.usage().used_blocks == len(files) - 1
    result = again.generate([shared], GREEDY, detokenize=False)[0]
    assert result.token_ids == reference_greedy(again, shared, 4)[0]
    assert_no_leaks(again)


def test_another_layout_is_skipped_and_a_half_written_temp_file_ignored(tiny_loaded, tmp_path):
    shared = prompts(tiny_loaded.config.vocab_size, 1, 33)[0]
    spill_to_disk(tiny_loaded, tmp_path, shared)
    n = len(list(tmp_path.glob(f"*{SUFFIX}")))
    half = tmp_path / f"{TEMP_PREFIX}{'ab' * 16}-1"
    half.write_bytes(b"PDKV\x10\x00")  # a crash mid-write
    other = make_engine(tiny_loaded, block_size=8, num_blocks=8, host_blocks=4, disk_dir=str(tmp_path),
                        kv_dtype="int8")
    assert other.pool.lower.disk.usage().used_blocks == 0 and not half.exists()
    assert other.pool.lower.disk.skipped == n + 1
    assert list(tmp_path.glob(f"*{SUFFIX}")) == []
