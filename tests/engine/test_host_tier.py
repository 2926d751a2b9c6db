"""The host tier under the block pool: eviction copies a block down, a prefix lookup loads it back.

Exact block ids, slots, event order and bytes; every flow ends with a leak check.
"""

from __future__ import annotations

import torch

from pdserve.engine.block_pool import BlockPool
from pdserve.engine.events import BlockRemoved, BlockStored, Tier, index_key
from pdserve.engine.hashing import BlockHash
from pdserve.engine.host_tier import HostTier

BS = 4


def h(i: int) -> BlockHash:
    return BlockHash(bytes([i]) * 16)


def make_pool(num_blocks: int = 2, host_slots: int = 2) -> tuple[BlockPool, torch.Tensor, HostTier]:
    kv = torch.zeros(2, 2, num_blocks, BS, 1, 3)  # [layer, K|V, block, offset, head, row]
    host = HostTier(kv, host_slots)
    return BlockPool(num_blocks, BS, host), kv, host


def fill(pool: BlockPool, kv: torch.Tensor, value: float, block_hash: BlockHash,
         parent: BlockHash | None = None) -> int:
    (b,) = pool.allocate(1)
    kv[:, :, b] = value
    pool.commit(b, block_hash, parent, (int(value),) * BS)
    pool.release([b])
    return b


def assert_clean(pool: BlockPool) -> None:
    assert pool.leaked_blocks() == []
    assert pool.num_free_blocks == pool.num_blocks


def test_an_evicted_block_goes_to_host_and_comes_back_bit_for_bit():
    pool, kv, host = make_pool()
    fill(pool, kv, 1.0, h(1))
    fill(pool, kv, 2.0, h(2), h(1))
    pool.drain_events()
    fill(pool, kv, 3.0, h(3))  # evicts h(1), the least recently used, into host slot 0
    events = pool.drain_events()
    assert events[:2] == [BlockRemoved(h(1), 0, Tier.DEVICE),
                          BlockStored(h(1), None, (1,) * BS, 0, Tier.HOST)]
    assert pool.match_prefix([h(1)]) == [] and host.match([h(1), h(2)]) == 1
    kv[:, :, 0] = 0.0  # nothing of the device block is left
    hit = pool.acquire_prefix([h(1)])
    assert hit.restored == {Tier.HOST: 1}
    restored = hit.block_ids[0]
    assert torch.equal(kv[:, :, restored], torch.full_like(kv[:, :, restored], 1.0))
    assert BlockRemoved(h(1), 0, Tier.HOST) in pool.drain_events()
    pool.release(hit.block_ids)
    assert_clean(pool)


def test_device_run_then_host_run_is_one_prefix_hit():
    pool, kv, host = make_pool(num_blocks=2, host_slots=4)
    fill(pool, kv, 1.0, h(1))
    fill(pool, kv, 2.0, h(2), h(1))
    fill(pool, kv, 3.0, h(3))  # h(1) down
    fill(pool, kv, 4.0, h(4))  # h(2) down
    hit = pool.acquire_prefix([h(1), h(2), h(5)])
    assert len(hit.block_ids) == 2 and hit.restored == {Tier.HOST: 2}
    assert pool.prefix_chain(hit.block_ids[1]) == hit.block_ids  # the chain is whole again (audit)
    pool.release(hit.block_ids)
    assert_clean(pool)


def test_a_full_host_tier_drops_its_least_recently_used_block():
    pool, kv, host = make_pool(num_blocks=1, host_slots=1)
    fill(pool, kv, 1.0, h(1))
    fill(pool, kv, 2.0, h(2))  # h(1) to host
    pool.drain_events()
    fill(pool, kv, 3.0, h(3))  # h(2) to host; h(1) leaves it (no disk tier): gone
    assert pool.drain_events() == [BlockRemoved(h(2), 0, Tier.DEVICE), BlockRemoved(h(1), 0, Tier.HOST),
                                   BlockStored(h(2), None, (2,) * BS, 0, Tier.HOST),
                                   BlockStored(h(3), None, (3,) * BS, 0, Tier.DEVICE)]
    assert host.match([h(1)]) == 0 and host.match([h(2)]) == 1
    assert [u.used_blocks for u in pool.tier_usage()] == [0, 1]
    assert_clean(pool)


def test_cached_hashes_name_each_tier_by_its_own_key_and_reset_clears_the_host():
    pool, kv, host = make_pool(num_blocks=1, host_slots=2)
    fill(pool, kv, 1.0, h(1))
    fill(pool, kv, 2.0, h(2))
    assert set(pool.cached_hashes()) == {h(2), index_key(h(1), Tier.HOST)}
    assert index_key(h(1), Tier.HOST) != h(1)
    pool.reset_cache()
    assert pool.cached_hashes() == [] and host.match([h(1)]) == 0
    assert_clean(pool)


def test_restore_stops_where_the_pool_has_no_block_to_give():
    pool, kv, host = make_pool(num_blocks=2, host_slots=4)
    fill(pool, kv, 1.0, h(1))
    fill(pool, kv, 2.0, h(2), h(1))
    fill(pool, kv, 3.0, h(3))
    fill(pool, kv, 4.0, h(4))  # h(1), h(2) in host
    held = pool.allocate(1)  # one block left to give
    hit = pool.acquire_prefix([h(1), h(2)])
    assert len(hit.block_ids) == 1 and host.match([h(2)]) == 1
    pool.release(hit.block_ids)
    pool.release(held)
    assert_clean(pool)
