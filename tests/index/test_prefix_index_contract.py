"""One contract, three implementations: InMemoryPrefixIndex (fake clock), RedisPrefixIndex (real server),
and the router's IndexMirror over a real server (writes through RedisPrefixIndex, reads through the
mirror once it has caught up with the feed: IndexMirror.sync, as the router's start does)."""

from __future__ import annotations

import hashlib
import logging
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import pytest

from pdserve.index.base import Lease, PrefixIndex, WorkerKey
from pdserve.index.memory import InMemoryPrefixIndex
from pdserve.index.mirror import IndexMirror
from pdserve.index.redis_index import RedisPrefixIndex
from pdserve.index.redis_layout import RETAIN_S, RedisKeys

LONG_TTL = 60.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass(frozen=True)
class Harness:
    index: PrefixIndex
    short_ttl: float
    let_pass: Callable[[float], None]  # let this many seconds go by, in the index's time

    def expire_short_leases(self) -> None:
        self.let_pass(self.short_ttl + 0.15)


class MirrorReads:
    """Writes go to Redis, reads to the mirror after it caught up with everything written so far."""

    def __init__(self, writer: RedisPrefixIndex, mirror: IndexMirror) -> None:
        self.writer, self.mirror = writer, mirror

    def apply(self, worker: WorkerKey, stored: Sequence[bytes], removed: Sequence[bytes]) -> None:
        self.writer.apply(worker, stored, removed)

    def replace(self, worker: WorkerKey, hashes: Iterable[bytes]) -> None:
        self.writer.replace(worker, hashes)

    def remove_worker(self, worker_id: str) -> None:
        self.writer.remove_worker(worker_id)

    def set_live(self, worker: WorkerKey, ttl_s: float) -> Lease:
        return self.writer.set_live(worker, ttl_s)

    def sweep(self) -> int:
        return self.writer.sweep()

    def drop_older_epochs(self, worker: WorkerKey) -> int:
        return self.writer.drop_older_epochs(worker)

    def touch(self, worker: WorkerKey, every_s: float) -> None:
        self.writer.touch(worker, every_s)

    def match(self, block_hashes: Sequence[bytes]) -> dict[str, int]:
        self.mirror.sync()
        return self.mirror.match(block_hashes)

    def worker_hashes(self, worker_id: str) -> set[bytes]:
        self.mirror.sync()
        return self.mirror.worker_hashes(worker_id)

    def live_workers(self) -> dict[str, int]:
        self.mirror.sync()
        return self.mirror.live_workers()


@pytest.fixture(params=["memory", "redis", "mirror"])
def h(request) -> Harness:
    if request.param == "memory":
        clock = FakeClock()
        yield Harness(InMemoryPrefixIndex(clock), short_ttl=1.0, let_pass=clock.advance)
        return
    client, namespace = request.getfixturevalue("redis_client"), request.getfixturevalue("namespace")
    index = RedisPrefixIndex(client, namespace=namespace)
    if request.param == "redis":
        yield Harness(index, short_ttl=0.3, let_pass=time.sleep)
        return
    mirror = IndexMirror(client, namespace)
    mirror.start()
    try:
        yield Harness(MirrorReads(index, mirror), short_ttl=0.3, let_pass=time.sleep)
    finally:
        mirror.stop()


def blk(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(4, "little"), digest_size=16).digest()


def blocks(*ids: int) -> list[bytes]:
    return [blk(i) for i in ids]


PROMPT = blocks(*range(8))


def live(h: Harness, worker_id: str, epoch: int = 1, ttl: float = LONG_TTL) -> WorkerKey:
    key = WorkerKey(worker_id, epoch)
    assert h.index.set_live(key, ttl) in (Lease.STARTED, Lease.RENEWED)
    return key


def test_exact_depths_for_several_workers(h):
    for worker_id, held in {"a": range(5), "b": range(2), "c": range(8), "d": range(1, 6)}.items():
        h.index.apply(live(h, worker_id), blocks(*held), [])

    assert h.index.match(PROMPT) == {"a": 5, "b": 2, "c": 8}
    assert h.index.match(PROMPT[:3]) == {"a": 3, "b": 2, "c": 3}
    assert h.index.match(PROMPT[1:]) == {"a": 4, "b": 1, "c": 7, "d": 5}  # any list: the index is agnostic


def test_depth_stops_at_the_first_missing_block(h):
    h.index.apply(live(h, "a"), blocks(0, 1, 3), [])

    assert h.index.match(PROMPT) == {"a": 2}


def test_removed_blocks_vanish_from_match_and_worker_hashes(h):
    a = live(h, "a")
    h.index.apply(a, blocks(0, 1, 2, 3), [])
    h.index.apply(a, [], blocks(2))

    assert h.index.match(PROMPT) == {"a": 2}
    assert h.index.worker_hashes("a") == set(blocks(0, 1, 3))

    h.index.apply(a, [], blocks(0))
    assert h.index.match(PROMPT) == {}


def test_a_hash_stored_and_removed_in_one_apply_ends_removed(h):
    h.index.apply(live(h, "a"), blocks(0, 1), blocks(1))

    assert h.index.worker_hashes("a") == set(blocks(0))


def test_dead_worker_is_ignored_then_swept(h):
    h.index.apply(live(h, "dead", ttl=h.short_ttl), blocks(0, 1, 2), [])
    h.index.apply(live(h, "alive"), blocks(0, 1), [])
    assert h.index.match(PROMPT) == {"dead": 3, "alive": 2}

    h.expire_short_leases()

    assert h.index.live_workers() == {"alive": 1}
    assert h.index.match(PROMPT) == {"alive": 2}
    assert h.index.worker_hashes("dead") == set(blocks(0, 1, 2))  # ignored, not yet cleaned
    assert h.index.sweep() == 3
    assert h.index.worker_hashes("dead") == set()
    assert h.index.worker_hashes("alive") == set(blocks(0, 1))
    assert h.index.sweep() == 0


def test_restarted_worker_old_epoch_never_counts(h):
    old = live(h, "a", epoch=1)
    h.index.apply(old, blocks(0, 1, 2, 3), [])

    new = live(h, "a", epoch=2)
    assert h.index.match(PROMPT) == {}
    h.index.apply(new, blocks(0, 1), [])
    assert h.index.match(PROMPT) == {"a": 2}

    assert h.index.set_live(old, LONG_TTL) is Lease.SUPERSEDED  # a zombie cannot take the lease back
    h.index.apply(old, blocks(4), [])  # nor write any more
    assert h.index.worker_hashes("a") == set(blocks(0, 1, 2, 3))
    assert h.index.match(PROMPT) == {"a": 2}
    assert h.index.live_workers() == {"a": 2}

    assert h.index.sweep() == 4
    assert h.index.worker_hashes("a") == set(blocks(0, 1))


def test_remove_worker_forgets_entries_and_lease_but_not_the_epoch(h):
    a = live(h, "a", epoch=3)
    h.index.apply(a, blocks(0, 1), [])
    h.index.apply(live(h, "b"), blocks(0), [])

    h.index.remove_worker("a")

    assert h.index.match(PROMPT) == {"b": 1}
    assert h.index.worker_hashes("a") == set()
    assert h.index.live_workers() == {"b": 1}
    assert h.index.set_live(WorkerKey("a", 2), LONG_TTL) is Lease.SUPERSEDED


def test_lease_states(h):
    a = WorkerKey("a", 1)
    assert h.index.set_live(a, h.short_ttl) is Lease.STARTED
    assert h.index.set_live(a, h.short_ttl) is Lease.RENEWED
    h.expire_short_leases()
    assert h.index.live_workers() == {}
    assert h.index.set_live(a, LONG_TTL) is Lease.STARTED
    assert h.index.set_live(WorkerKey("a", 2), LONG_TTL) is Lease.STARTED
    assert h.index.set_live(a, LONG_TTL) is Lease.SUPERSEDED


def test_replace_makes_entries_exact(h):
    a = live(h, "a")
    h.index.apply(a, blocks(0, 1, 2, 3), [])

    h.index.replace(a, blocks(0, 1, 5))

    assert h.index.worker_hashes("a") == set(blocks(0, 1, 5))
    assert h.index.match(PROMPT) == {"a": 2}


def test_empty_prompt_and_unknown_blocks_match_nobody(h):
    h.index.apply(live(h, "a"), blocks(0), [])

    assert h.index.match([]) == {}
    assert h.index.match(blocks(100, 0)) == {}


def test_worker_ids_with_separators_and_binary_hashes(h):
    odd = live(h, "node-1:gpu@0 x")
    hashes = [b"\x00" * 16, b"@:" * 8, b"\xff" * 16]
    h.index.apply(odd, hashes, [])

    assert h.index.match(hashes) == {"node-1:gpu@0 x": 3}
    assert h.index.live_workers() == {"node-1:gpu@0 x": 1}


def reference_depths(holdings: dict[str, set[bytes]], prompt: list[bytes]) -> dict[str, int]:
    depths = {}
    for worker_id, held in holdings.items():
        depth = next((i for i, b in enumerate(prompt) if b not in held), len(prompt))
        if depth:
            depths[worker_id] = depth
    return depths


def test_random_holdings_agree_with_a_brute_force_reference(h):
    rng = random.Random(7)
    holdings = {f"w{i}": {blk(b) for b in range(24) if rng.random() < 0.85} for i in range(6)}
    for worker_id, held in holdings.items():
        h.index.apply(live(h, worker_id), sorted(held), [])

    for _ in range(20):
        start = rng.randrange(4)
        prompt = blocks(*range(start, start + rng.randrange(1, 20)))
        assert h.index.match(prompt) == reference_depths(holdings, prompt)


def test_large_batches_and_a_large_replace(h):
    a = live(h, "a")
    many = blocks(*range(3000))
    h.index.apply(a, many, many[2000:])
    assert len(h.index.worker_hashes("a")) == 2000
    assert h.index.match(many) == {"a": 2000}

    h.index.replace(a, many[:1000] + many[2500:])
    assert h.index.worker_hashes("a") == set(many[:1000] + many[2500:])
    assert h.index.match(many) == {"a": 1000}
    assert h.index.match(many[2500:]) == {"a": 500}


def test_a_prompt_longer_than_one_lua_unpack(h):
    a = live(h, "a")
    many = blocks(*range(14000))  # a 224k-token prompt at 16 tokens a block
    h.index.apply(a, many, [])

    assert h.index.match(many) == {"a": 14000}


def test_a_new_epoch_drops_its_own_older_epochs_only(h):
    old = live(h, "a", epoch=1)
    h.index.apply(old, blocks(0, 1, 2), [])
    other = live(h, "b", epoch=1)
    h.index.apply(other, blocks(0, 1), [])
    new = live(h, "a", epoch=2)
    h.index.apply(new, blocks(0), [])

    assert h.index.drop_older_epochs(new) == 3
    assert h.index.worker_hashes("a") == set(blocks(0))
    assert h.index.worker_hashes("b") == set(blocks(0, 1))
    assert h.index.match(PROMPT) == {"a": 1, "b": 2}
    assert h.index.drop_older_epochs(new) == 0


def test_touch_keeps_everything_matchable(h):
    a = live(h, "a")
    h.index.apply(a, blocks(0, 1, 2), [])
    for _ in range(3):
        h.index.touch(a, every_s=5.0)
    assert h.index.match(PROMPT) == {"a": 3}


# --- Redis only: what each key's life is, and junk it meets --------------------------------------------

@pytest.fixture
def redis_index(redis_client, namespace) -> RedisPrefixIndex:
    return RedisPrefixIndex(redis_client, namespace)


def test_every_index_key_expires_and_a_touch_renews_the_block_sets(redis_index, redis_client, namespace):
    a = WorkerKey("a", 1)
    redis_index.set_live(a, LONG_TTL)
    redis_index.apply(a, blocks(*range(600)), [])
    names = redis_client.keys(f"{namespace}:*")
    # blocks, the entry's hash set, entries, live, epoch, workers, the feed and its counter
    assert len(names) == 600 + 7
    keys = RedisKeys(namespace)
    assert all(0 < redis_client.pttl(k) <= RETAIN_S * 1000 for k in names if k != keys.epoch("a").encode())
    assert redis_client.pttl(keys.epoch("a")) > 0
    for k in names:
        redis_client.pexpire(k, 60_000)  # as if a minute of RETAIN_S were left on each
    for _ in range(3):  # one full pass in 3 calls: 600 hashes in slices of at least 256
        redis_index.touch(a, every_s=RETAIN_S / 9)
    renewed = [k for k in names if k.startswith(keys.block_prefix) and redis_client.pttl(k) > 60_000]
    assert len(renewed) == 600


def test_a_malformed_entry_member_is_skipped_with_a_warning(redis_index, redis_client, namespace, caplog):
    keys = RedisKeys(namespace)
    gone = WorkerKey("gone", 1)
    redis_index.set_live(gone, 0.2)
    redis_index.apply(gone, blocks(0, 1), [])
    redis_client.sadd(keys.entries, "no-epoch-here", b"\xff\xfe@1")
    redis_client.sadd(keys.workers, b"\xff")
    redis_client.set(keys.live_prefix.encode() + b"\xff", "1")
    caplog.set_level(logging.WARNING)
    time.sleep(0.35)

    assert redis_index.live_workers() == {}
    assert redis_index.sweep() == 2
    assert redis_index.worker_hashes("gone") == set()
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert f"{keys.entries} member b'no-epoch-here'" in warned and keys.live_prefix in warned
