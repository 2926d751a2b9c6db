"""IndexMirror over a real redis-server: the feed carries every change, a lost event or a lost Redis
makes the mirror re-read the index, it never claims a lease that ran out, and it agrees with Redis's
own match on random workloads. (The PrefixIndex contract over the mirror is in
test_prefix_index_contract.py.)"""

from __future__ import annotations

import hashlib
import uuid

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deploy.redis_server import RedisServer
from pdserve.index.base import StoreUnavailable, WorkerKey
from pdserve.index.feed import decode_event
from pdserve.index.mirror import IndexMirror, MirrorStatus
from pdserve.index.redis_index import RedisPrefixIndex
from pdserve.index.redis_layout import RedisKeys

LONG_TTL = 60.0


def blk(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(4, "little"), digest_size=16).digest()


def blocks(*ids: int) -> list[bytes]:
    return [blk(i) for i in ids]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def writer(redis_client, namespace) -> RedisPrefixIndex:
    return RedisPrefixIndex(redis_client, namespace)


@pytest.fixture
def mirror(redis_client, namespace):
    m = IndexMirror(redis_client, namespace)
    m.start()
    yield m
    m.stop()


def live(index: RedisPrefixIndex, worker_id: str, epoch: int = 1, ttl: float = LONG_TTL) -> WorkerKey:
    key = WorkerKey(worker_id, epoch)
    index.set_live(key, ttl)
    return key


def feed_events(client: redis.Redis, namespace: str):
    return [decode_event(i, f) for i, f in client.xrange(RedisKeys(namespace).feed)]


def test_every_change_goes_on_the_feed_numbered_one_after_another(writer, redis_client, namespace):
    a1 = live(writer, "a", epoch=1)
    writer.apply(a1, blocks(0, 1, 2), blocks(2))
    writer.replace(a1, blocks(1, 5))  # stores 5, removes 0: one apply
    a2 = live(writer, "a", epoch=2)
    writer.apply(a1, blocks(9), [])  # refused (a newer epoch): writes nothing, publishes nothing
    writer.apply(a2, blocks(7), [])
    assert writer.drop_older_epochs(a2) == 2
    b = live(writer, "b")
    writer.apply(b, blocks(3), [])
    redis_client.delete(RedisKeys(namespace).live("b"))  # b's lease gone: the sweep drops it
    assert writer.sweep() == 1
    writer.remove_worker("a")

    events = feed_events(redis_client, namespace)
    assert [(e.entry, set(e.stored), set(e.removed)) for e in events] == [
        (a1, set(blocks(0, 1, 2)), set(blocks(2))),
        (a1, set(blocks(5)), set(blocks(0))),
        (a2, set(blocks(7)), set()),
        (a1, set(), set(blocks(1, 5))),  # drop_older_epochs
        (WorkerKey("b", 1), set(blocks(3)), set()),
        (WorkerKey("b", 1), set(), set(blocks(3))),  # sweep
        (a2, set(), set(blocks(7))),  # remove_worker
    ]
    seqs = [e.seq for e in events]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    assert seqs[-1] == int(redis_client.get(RedisKeys(namespace).feed_seq))
    assert seqs[0] > 10**15  # seeded from the clock in microseconds, and carried exactly


def test_a_counter_bumped_by_hand_is_a_lost_event_and_the_mirror_rereads(writer, mirror, redis_client,
                                                                          namespace):
    a = live(writer, "a")
    writer.apply(a, blocks(0, 1), [])
    mirror.sync()
    assert mirror.snapshots == 1 and mirror.match(blocks(0, 1, 2)) == {"a": 2}

    redis_client.incr(RedisKeys(namespace).feed_seq)  # as if an event had been lost
    writer.apply(a, blocks(2), [])
    mirror.sync()

    assert mirror.snapshots == 2
    assert mirror.match(blocks(0, 1, 2)) == {"a": 3}


def test_a_counter_that_moved_without_any_event_is_noticed_between_events(writer, mirror, redis_client,
                                                                          namespace):
    writer.apply(live(writer, "a"), blocks(0), [])
    mirror.sync()
    redis_client.incrby(RedisKeys(namespace).feed_seq, 5)  # no event follows

    mirror.sync()  # returns once the feed thread's check re-read the index at the new number

    assert mirror.snapshots == 2
    assert mirror.position().seq == int(redis_client.get(RedisKeys(namespace).feed_seq))


def test_entries_trimmed_from_the_stream_before_the_mirror_read_them(writer, mirror, redis_client, namespace):
    a = live(writer, "a")
    writer.apply(a, blocks(0), [])
    mirror.sync()
    mirror.stop()  # the mirror falls behind ...
    writer.apply(a, blocks(1), [])
    writer.apply(a, blocks(2), [])
    redis_client.xtrim(RedisKeys(namespace).feed, maxlen=0)  # ... past what the stream keeps
    writer.apply(a, blocks(3), [])

    mirror.start()

    assert mirror.snapshots == 2
    assert mirror.match(blocks(0, 1, 2, 3)) == {"a": 4}


def test_a_junk_feed_entry_makes_the_mirror_reread_and_carry_on(writer, mirror, redis_client, namespace,
                                                                caplog):
    a = live(writer, "a")
    writer.apply(a, blocks(0), [])
    mirror.sync()
    redis_client.xadd(RedisKeys(namespace).feed, {"v": "99", "seq": "1"})
    writer.apply(a, blocks(1), [])
    mirror.sync()

    assert mirror.snapshots >= 2
    assert mirror.match(blocks(0, 1)) == {"a": 2}
    assert "version b'99'" in caplog.text


def test_hashes_of_another_size_are_refused_at_the_writer(writer):
    with pytest.raises(ValueError, match="has 3 bytes"):
        writer.apply(live(writer, "a"), [b"abc"], [])


def test_redis_restarting_empty_and_coming_back(tmp_path):
    clock = FakeClock()
    with RedisServer() as server:
        writer = RedisPrefixIndex(redis.Redis.from_url(server.url), "ns")
        mirror = IndexMirror(redis.Redis.from_url(server.url, socket_timeout=2.0), "ns", clock=clock)
        a = live(writer, "a", ttl=30.0)
        writer.apply(a, blocks(0, 1), [])
        mirror.start()
        try:
            assert mirror.match(blocks(0, 1)) == {"a": 2}
            server.stop()
            with pytest.raises(StoreUnavailable):
                mirror.sync()
            # Redis gone: the last state serves, for as long as a's lease could still hold ...
            assert mirror.match(blocks(0, 1)) == {"a": 2}
            clock.now += 31.0
            assert mirror.match(blocks(0, 1)) == {}  # ... and not a moment longer
            assert mirror.live_workers() == {}

            server.start()  # back, empty (no persistence), on the same port
            mirror.sync()
            assert mirror.worker_hashes("a") == set()
            a2 = live(writer, "a", epoch=2, ttl=30.0)  # the worker's next heartbeat and republish
            writer.replace(a2, blocks(0))
            mirror.sync()
            assert mirror.match(blocks(0, 1)) == {"a": 1}
            assert mirror.status is MirrorStatus.FOLLOWING
        finally:
            mirror.stop()


def test_a_flushed_redis_is_reread(writer, mirror, redis_client):
    writer.apply(live(writer, "a"), blocks(0, 1), [])
    mirror.sync()
    redis_client.flushdb()

    mirror.sync()

    assert mirror.worker_hashes("a") == set() and mirror.match(blocks(0, 1)) == {}


def test_without_redis_at_start_the_mirror_is_empty_and_match_refuses():
    server = RedisServer()
    server.start()
    url = server.url
    server.stop()
    mirror = IndexMirror(redis.Redis.from_url(url, socket_timeout=1.0), "ns")
    mirror.start(sync_timeout_s=1.0)
    try:
        assert mirror.status in (MirrorStatus.EMPTY, MirrorStatus.UNREACHABLE)
        with pytest.raises(StoreUnavailable, match="has not read the index"):
            mirror.match(blocks(0))
    finally:
        mirror.stop()


def test_a_client_that_times_out_within_one_block_is_refused(redis_server):
    with pytest.raises(ValueError, match="client of its own"):
        IndexMirror(redis.Redis.from_url(redis_server.url, socket_timeout=0.1), "ns")


# --- a random workload: the mirror agrees with Redis's own match -------------------------------------

WORKERS = ("w0", "w1", "w2")  # per example, under a fresh prefix: epochs start at 1 each time
op = st.one_of(
    st.tuples(st.just("apply"), st.sampled_from(WORKERS), st.lists(st.integers(0, 11), max_size=8),
              st.lists(st.integers(0, 11), max_size=4)),
    st.tuples(st.just("replace"), st.sampled_from(WORKERS), st.lists(st.integers(0, 11), max_size=10)),
    st.tuples(st.just("restart"), st.sampled_from(WORKERS)),
    st.tuples(st.just("sweep"),),
    st.tuples(st.just("remove"), st.sampled_from(WORKERS)),
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(op, min_size=1, max_size=25), prompts=st.lists(
    st.lists(st.integers(0, 11), min_size=1, max_size=12), min_size=1, max_size=6))
def test_the_mirror_agrees_with_redis_on_random_workloads(writer, mirror, ops, prompts):
    run = uuid.uuid4().hex[:6]
    epochs = {f"{run}{w}": 1 for w in WORKERS}
    for w in WORKERS:
        live(writer, f"{run}{w}", 1)
    for step in ops:
        kind, *rest = step
        if rest:
            rest[0] = f"{run}{rest[0]}"
        step = (kind, *rest)
        if kind == "apply":
            writer.apply(WorkerKey(step[1], epochs[step[1]]), blocks(*step[2]), blocks(*step[3]))
        elif kind == "replace":
            writer.replace(WorkerKey(step[1], epochs[step[1]]), blocks(*step[2]))
        elif kind == "restart":
            epochs[step[1]] += 1
            new = live(writer, step[1], epochs[step[1]])
            writer.drop_older_epochs(new)
        elif kind == "sweep":
            writer.sweep()
        else:
            writer.remove_worker(step[1])
            epochs[step[1]] += 1
            live(writer, step[1], epochs[step[1]])
    mirror.sync()
    for prompt in prompts:
        assert mirror.match(blocks(*prompt)) == writer.match(blocks(*prompt))
    for w in WORKERS:
        assert mirror.worker_hashes(f"{run}{w}") == writer.worker_hashes(f"{run}{w}")
    assert mirror.live_workers() == writer.live_workers()
