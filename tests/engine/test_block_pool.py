"""BlockPool: exact block ids, LRU eviction order, ref counts, events."""

import pytest

from pdserve.engine.block_pool import BlockPool, Discarded, NoFreeBlocksError
from pdserve.engine.events import BlockRemoved, BlockStored


def h(i: int) -> bytes:
    return bytes([i]) * 16


def assert_no_leaks(pool: BlockPool) -> None:
    assert pool.leaked_blocks() == []
    assert pool.num_free_blocks == pool.num_blocks


def test_allocate_hands_out_lowest_free_ids_first():
    pool = BlockPool(4, 16)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(1) == [2]
    assert pool.num_free_blocks == 1
    pool.release([0, 1, 2])
    assert_no_leaks(pool)


def test_allocate_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(2, 16)
    pool.allocate(1)
    with pytest.raises(NoFreeBlocksError, match="need 2 KV blocks, 1 free"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1


def test_committed_blocks_stay_cached_and_match_by_prefix():
    pool = BlockPool(4, 2)
    blocks = pool.allocate(3)
    pool.commit(blocks[0], h(1), None, [1, 2])
    pool.commit(blocks[1], h(2), h(1), [3, 4])
    pool.release(blocks)  # block 2 had no hash: back to FREE
    assert pool.num_cached_blocks == 2
    assert pool.match_prefix([h(1), h(2), h(3)]) == [0, 1]
    assert pool.match_prefix([h(9), h(2)]) == []  # depth stops at the first missing block
    assert_no_leaks(pool)


def test_acquire_takes_cached_block_out_of_eviction():
    pool = BlockPool(2, 2)
    [b] = pool.allocate(1)
    pool.commit(b, h(1), None, [1, 2])
    pool.release([b])
    pool.acquire([b])
    assert pool.ref_count(b) == 1
    assert pool.num_free_blocks == 1
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(2)
    pool.release([b])
    assert_no_leaks(pool)


def test_eviction_is_lru_among_unreferenced_and_tail_first_within_a_sequence():
    pool = BlockPool(4, 1)
    seq_a = pool.allocate(2)  # [0, 1]
    seq_b = pool.allocate(2)  # [2, 3]
    for i, b in enumerate(seq_a + seq_b):
        pool.commit(b, h(10 + i), None, [i])
    pool.release(seq_a)  # tail first: 1 then 0 become least recently used
    pool.release(seq_b)  # then 3, 2
    assert pool.allocate(1) == [1]
    assert pool.allocate(1) == [0]
    assert pool.allocate(1) == [3]
    assert pool.match_prefix([h(12)]) == [2]
    events = pool.drain_events()
    removed = [e.block_id for e in events if isinstance(e, BlockRemoved)]
    assert removed == [1, 0, 3]
    pool.release([1, 0, 3])
    assert_no_leaks(pool)


def test_shared_block_needs_every_reference_released():
    pool = BlockPool(2, 2)
    [b] = pool.allocate(1)
    pool.commit(b, h(1), None, [5, 6])
    pool.acquire([b])
    assert pool.ref_count(b) == 2
    pool.release([b])
    assert pool.leaked_blocks() == [b]
    pool.release([b])
    assert_no_leaks(pool)


def test_duplicate_hash_leaves_second_block_private():
    pool = BlockPool(2, 2)
    a, b = pool.allocate(2)
    assert pool.commit(a, h(1), None, [1, 2]) is True
    assert pool.commit(b, h(1), None, [1, 2]) is False
    pool.release([a, b])
    assert pool.num_cached_blocks == 1
    assert_no_leaks(pool)


def test_events_record_stores_and_removals_in_order():
    pool = BlockPool(1, 2)
    [b] = pool.allocate(1)
    pool.commit(b, h(1), None, [1, 2])
    pool.release([b])
    pool.allocate(1)  # evicts the cached block
    assert pool.drain_events() == [BlockStored(h(1), None, (1, 2), 0), BlockRemoved(h(1), 0)]
    assert pool.drain_events() == []


def test_double_release_is_an_error():
    pool = BlockPool(1, 2)
    [b] = pool.allocate(1)
    pool.release([b])
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release([b])


def committed_chain(pool: BlockPool, tokens: list[list[int]]) -> list[int]:
    """Blocks committed as one prompt's chain h(1) <- h(2) <- ..., still referenced."""
    blocks = pool.allocate(len(tokens))
    for i, (b, t) in enumerate(zip(blocks, tokens)):
        pool.commit(b, h(i + 1), h(i) if i else None, t)
    return blocks


def test_a_cached_block_keeps_its_tokens_and_its_prefix_chain_root_first():
    pool = BlockPool(6, 2)
    pool.allocate(1)  # block 0 stays private, so the chain's ids are not its positions
    blocks = committed_chain(pool, [[1, 2], [3, 4], [5, 6]])
    pool.release(blocks)
    assert blocks == [1, 2, 3]
    assert [pool.block_tokens(b) for b in blocks] == [(1, 2), (3, 4), (5, 6)]
    assert pool.prefix_chain(3) == [1, 2, 3] and pool.prefix_chain(1) == [1]
    assert sorted(pool.cached_block_ids()) == [1, 2, 3]
    assert pool.prefix_chain(0) is None  # never hashed
    pool.release([0])
    assert_no_leaks(pool)


def test_a_block_whose_ancestor_was_evicted_has_no_chain():
    pool = BlockPool(2, 2)
    blocks = committed_chain(pool, [[1, 2], [3, 4]])
    pool.release(blocks[:1])
    pool.release(blocks[1:])  # the child is released last, so the root is evicted first
    pool.allocate(1)
    assert pool.block_hash(0) is None and pool.block_tokens(0) == ()
    assert pool.prefix_chain(1) is None and pool.match_prefix([h(1), h(2)]) == []
    pool.release([0])
    assert_no_leaks(pool)


def test_discard_evicts_a_cached_block_and_records_its_removal():
    pool = BlockPool(3, 2)
    blocks = committed_chain(pool, [[1, 2], [3, 4]])
    pool.release(blocks)
    pool.drain_events()
    assert pool.discard(1, h(2)) is Discarded.EVICTED
    assert pool.drain_events() == [BlockRemoved(h(2), 1)]
    assert pool.match_prefix([h(1), h(2)]) == [0] and pool.block_tokens(1) == ()
    assert pool.num_cached_blocks == 1
    assert pool.allocate(2) == [2, 1]  # FREE now, handed out before the cached root is evicted
    assert pool.discard(1, h(2)) is Discarded.GONE and pool.drain_events() == []
    pool.release([2, 1])
    assert_no_leaks(pool)


def test_discard_of_a_block_in_use_unlists_it_and_its_release_frees_it():
    pool = BlockPool(2, 2)
    [b] = committed_chain(pool, [[1, 2]])
    pool.drain_events()
    assert pool.discard(b, h(1)) is Discarded.UNLISTED
    assert pool.drain_events() == [BlockRemoved(h(1), b)]
    assert pool.match_prefix([h(1)]) == [] and pool.ref_count(b) == 1
    pool.release([b])
    assert pool.num_cached_blocks == 0 and pool.cached_block_ids() == []  # FREE, not CACHED
    assert_no_leaks(pool)
