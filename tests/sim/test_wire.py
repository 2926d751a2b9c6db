"""sim/measure/wire.py: the KV push `pdserve sim calibrate` times, through production's channel into a pool in
another process, and the receiver's refusal of a transfer that lost a chunk."""

from __future__ import annotations

import pytest

from pdserve.kvwire import KVLayout, WireError
from sim.measure.wire import FINGERPRINT, MIB, PoolReceiver, make_pool, push_seconds, transfer_frames


def test_the_receiver_fails_closed_on_a_missing_chunk():
    sender, receiver = make_pool(1, "float16", layers=4), make_pool(1, "float16", layers=4, fill=False)
    layout = KVLayout.of_cache(sender, FINGERPRINT)
    frames = [(h, bytes(p)) for h, p in transfer_frames(sender, layout, "t1", range(4), range(4),
                                                         layout.block_bytes)]
    assert len(frames) == 1 + 4 * 4 + 1  # BEGIN, one block per chunk, END
    del frames[2]
    with pytest.raises(WireError, match="END says 16 blocks / 1048576 bytes, got 15 / 983040"):
        PoolReceiver(receiver, layout).receive(frames)


def test_a_push_to_another_process_is_timed_once_every_block_is_written():
    """push_seconds raises unless the receiver wrote every (layer, block): a time is only reported
    for a whole transfer."""
    assert 0 < push_seconds(4, "float32", reps=1, chunk_bytes=2 * MIB) < 60


def test_a_pool_that_is_not_whole_blocks_is_refused():
    with pytest.raises(ValueError, match="3 MiB is not a whole number of 4194304-byte blocks"):
        make_pool(3, "float32")
