"""The change feed as a reader sees it (pdserve/index/feed.py): pure, no Redis."""

from __future__ import annotations

import pytest

from pdserve.index.base import WorkerKey
from pdserve.index.feed import (
    STREAM_START,
    FeedEvent,
    FeedPosition,
    FollowedIndex,
    LeaseView,
    MalformedEvent,
    decode_event,
    needs_snapshot,
)

A = WorkerKey("a", 1)
H = [bytes([i]) * 16 for i in range(4)]
LEASES = LeaseView({"a": (1, 100.0)}, read_at=0.0)


def event(seq: int, stored=(), removed=(), entry: WorkerKey = A) -> FeedEvent:
    return FeedEvent((seq, 0), seq, entry, tuple(stored), tuple(removed))


def test_events_apply_in_order_and_the_first_gap_stops_everything_after_it():
    index = FollowedIndex.from_snapshot(FeedPosition((1, 0), 1), {A: [H[0]]})

    gap = index.follow([event(2, [H[1]]), event(4, [H[2]]), event(5, [H[3]])])

    assert gap is not None and gap.seq == 4
    assert index.position == FeedPosition((2, 0), 2)
    assert index.match(H, LEASES, now=1.0) == {"a": 2}


def test_replaying_events_the_snapshot_already_reflects_ends_in_the_same_state():
    index = FollowedIndex.from_snapshot(FeedPosition(STREAM_START, 10), {A: [H[0], H[2]]})  # read after 12

    assert index.follow([event(11, [H[1], H[3]]), event(12, [], [H[3]])]) is None

    assert index.worker_hashes("a") == set(H[:3])


def test_a_lease_counts_until_it_would_run_out_and_only_at_its_epoch():
    index = FollowedIndex.from_snapshot(FeedPosition(STREAM_START, 0), {A: H, WorkerKey("a", 0): H})

    assert index.match(H, LEASES, now=99.9) == {"a": 4}
    assert index.match(H, LEASES, now=100.0) == {}
    assert LEASES.live(now=50.0) == {"a": 1} and LEASES.live(now=100.0) == {}


@pytest.mark.parametrize("mine, store, wanted", [
    (FeedPosition((5, 0), 7), FeedPosition((5, 0), 7), False),  # in step
    (FeedPosition((5, 0), 7), FeedPosition((6, 0), 9), False),  # entries to read explain it
    (FeedPosition((5, 0), 7), FeedPosition((5, 0), 8), True),  # bumped with no entry
    (FeedPosition((5, 0), 7), FeedPosition((6, 0), 3), True),  # counter went back
    (FeedPosition((5, 0), 7), FeedPosition(STREAM_START, 10**15), True),  # Redis lost it: reseeded
    (FeedPosition((5, 0), 7), FeedPosition(STREAM_START, 7), False),  # the stream expired, nothing lost
])
def test_when_the_store_position_calls_for_a_snapshot(mine, store, wanted):
    assert needs_snapshot(mine, store) is wanted


def test_entries_of_another_version_or_shape_are_malformed():
    fields = {b"v": b"1", b"seq": b"3", b"op": b"apply", b"entry": b"a@1", b"stored": H[0], b"removed": b""}
    assert decode_event(b"9-1", fields) == FeedEvent((9, 1), 3, A, (H[0],), ())
    for bad in ({**fields, b"v": b"2"}, {**fields, b"stored": b"abc"}, {**fields, b"entry": b"no-epoch"},
                {k: v for k, v in fields.items() if k != b"seq"}):
        with pytest.raises(MalformedEvent):
            decode_event(b"9-1", bad)
