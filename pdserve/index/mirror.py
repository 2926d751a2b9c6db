"""IndexMirror: the router's local copy of the Redis prefix index, kept current by the index's feed.

Workers write the index in Redis (RedisPrefixIndex); every script that changes an entry also
appends one entry to the namespace's feed, a Redis stream, with the next value of a counter
(redis_layout.py PUBLISH_FEED_LUA). A mirror reads the feed; every router replica runs its own,
over the same stream. match() then runs here, over dicts and sets, with no round trip.

    EMPTY ──start(): snapshot──▶ FOLLOWING ◀──────────────────────────────┐
                                 │  feed thread, in order:                │
                                 │    XREAD BLOCK after our position      │ Redis answers
                                 │    every check_s: leases, the store's  │ again
                                 │      counter and newest stream entry   │
                                 │    a gap, a junk entry, a counter that │
                                 │      moved with no event, or           │
                                 │      resnapshot_s gone by ──▶ snapshot │
                                 └──Redis does not answer──▶ UNREACHABLE ─┘
    stop() ends the feed thread; start() again follows on from the position it stopped at.

    snapshot: the feed's position (counter, newest stream id) and the leases in one script, then
              the entries set and every entry's hash set (pipelined); the events after that
              position are replayed on top (pdserve/index/feed.py says why that is exact)

What match() claims: an entry counts only while its worker's lease, as last read, holds the entry's
epoch and has time left (read time + PTTL). While Redis does not answer the mirror keeps its last
entries, and each worker drops out of the matches when its lease would have run out; with no
snapshot yet match() raises StoreUnavailable, so the router routes by load. A lease deleted
early (remove_worker, a new epoch) is seen within check_s.

NOTE: expiry is the one change the feed cannot carry (a set nobody renewed for RETAIN_S). It only
happens to the sets of a worker that is gone (whose lease no longer counts) or after Redis refused
a live worker's writes for RETAIN_S; resnapshot_s bounds how long the mirror can disagree then.

sync() is the seam production and tests share: read the feed's counter now, wait until the mirror
has followed up to it. start() ends with one, so a router starts routing on the whole index.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import redis

from pdserve.engine.hashing import BlockHash
from pdserve.index.base import StoreUnavailable, WorkerKey
from pdserve.index.feed import (
    STREAM_START,
    FeedEvent,
    FeedPosition,
    FollowedIndex,
    LeaseView,
    MalformedEvent,
    decode_event,
    format_stream_id,
    needs_snapshot,
    parse_stream_id,
)
from pdserve.index.redis_layout import (
    RETAIN_S,
    SEED_FROM_CLOCK_LUA,
    MalformedKeys,
    RedisKeys,
    milliseconds,
    parse_entry_member,
    require_bytes_client,
    store_errors,
)

log = logging.getLogger(__name__)

# KEYS: the feed's counter, the feed, the workers set. ARGV: lease key prefix, RETAIN ms.
# Returns {counter, newest stream id or "", then worker_id, epoch, lease PTTL ms for each lease}.
# NOTE: a missing counter is seeded here too, so a position always has a number: one read later, the
# first event must carry exactly that number + 1. Only then does it write: on a read-only replica it
# still answers.
FEED_STATE_LUA = SEED_FROM_CLOCK_LUA + """
if redis.call("EXISTS", KEYS[1]) == 0 then
  seed_from_clock(KEYS[1])
  redis.call("PEXPIRE", KEYS[1], ARGV[2])
end
local out = {redis.call("GET", KEYS[1]), ""}
local newest = redis.call("XREVRANGE", KEYS[2], "+", "-", "COUNT", 1)
if #newest > 0 then out[2] = newest[1][1] end
for _, w in ipairs(redis.call("SMEMBERS", KEYS[3])) do
  local epoch = redis.call("GET", ARGV[1] .. w)
  if epoch then
    out[#out + 1] = w
    out[#out + 1] = epoch
    out[#out + 1] = redis.call("PTTL", ARGV[1] .. w)
  end
end
return out
"""


class MirrorStatus(enum.Enum):
    EMPTY = "empty"  # no snapshot yet: match() raises StoreUnavailable
    FOLLOWING = "following"  # reading the feed
    UNREACHABLE = "unreachable"  # Redis does not answer: serving the last state, leases running out


@dataclass(frozen=True)
class MirrorConfig:
    block_s: float = 0.25  # one XREAD BLOCK; also how long stop() may wait for the feed thread
    check_s: float = 0.5  # leases and the store's position, between events
    resnapshot_s: float = 300.0  # a full re-read however well the feed went (see the module's NOTE)
    retry_s: float = 1.0  # after Redis did not answer
    batch: int = 256  # stream entries per XREAD

    def __post_init__(self) -> None:
        for name in ("block_s", "check_s", "resnapshot_s", "retry_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"mirror config: {name} must be positive, got {getattr(self, name)}")
        if self.batch < 1:
            raise ValueError(f"mirror config: batch must be >= 1, got {self.batch}")


@dataclass(frozen=True)
class _StoreState:
    position: FeedPosition
    leases: LeaseView


class IndexMirror:
    """The PrefixIndex read side (match, worker_hashes, live_workers), served from memory."""

    def __init__(self, client: redis.Redis, namespace: str = "pdserve", config: MirrorConfig | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        require_bytes_client(client)
        self.config = config or MirrorConfig()
        timeout = client.get_connection_kwargs().get("socket_timeout")
        if timeout is not None and timeout <= self.config.block_s:
            raise ValueError(f"the mirror's Redis client times out after {timeout} s, within one XREAD BLOCK "
                             f"of {self.config.block_s} s; give it a client of its own with a longer timeout")
        self._client, self._keys, self._clock = client, RedisKeys(namespace), clock
        self._state_script = client.register_script(FEED_STATE_LUA)
        self._malformed = MalformedKeys()
        self._index: FollowedIndex | None = None
        self._leases = LeaseView()
        self._lock = threading.Condition()
        self._status = MirrorStatus.EMPTY
        self._snapshot_wanted = False
        self._snapshot_at = self._next_check = float("-inf")
        self.snapshots = 0  # how many times the index was read whole (start, gaps, resnapshot_s)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- lifecycle ------------------------------------------------------------------------
    def start(self, sync_timeout_s: float = 10.0) -> None:
        """Read the index, start following the feed, and wait until caught up; with Redis down, start
        EMPTY (the feed thread keeps trying). After stop(), start() follows on from where it stopped."""
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("the index mirror is already running; stop() it first")
        self._stop.clear()
        self._thread = threading.Thread(target=self._follow_loop, name="index-mirror", daemon=True)
        self._thread.start()
        try:
            self.sync(sync_timeout_s)
        except (StoreUnavailable, TimeoutError) as e:
            log.warning("index mirror: starting without the index (%s); routing by load until Redis "
                        "answers", e)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.config.block_s + 5)

    @property
    def status(self) -> MirrorStatus:
        return self._status

    def sync(self, timeout_s: float = 5.0) -> None:
        """Refresh the leases and wait until the mirror holds every change the store had when called.
        StoreUnavailable when Redis does not answer, TimeoutError when the feed thread does not catch
        up within timeout_s."""
        state = self._read_state()
        self._take_leases(state.leases)
        if not self.wait_caught_up(state.position.seq, timeout_s):
            raise TimeoutError(f"the index mirror did not reach feed seq {state.position.seq} within "
                               f"{timeout_s} s (status {self._status.value}, at {self.position()})")

    def resnapshot(self, timeout_s: float = 10.0) -> None:
        """Read the index whole now, as resnapshot_s would later: the one way the mirror learns of what
        the feed cannot carry (keys deleted or evicted in Redis behind the workers' backs). Returns when
        the snapshot is in; TimeoutError when it is not within timeout_s (Redis does not answer)."""
        with self._lock:
            target = self.snapshots + 1
            self._snapshot_wanted = True
            if not self._lock.wait_for(lambda: self.snapshots >= target, timeout_s):
                raise TimeoutError(f"the index mirror did not re-read the index within {timeout_s} s "
                                   f"(status {self._status.value})")

    def wait_caught_up(self, seq: int, timeout_s: float) -> bool:
        """Whether the mirror reached feed seq `seq` (or a snapshot past it) within timeout_s."""
        def reached() -> bool:
            return self._index is not None and self._index.position.seq >= seq
        with self._lock:
            return self._lock.wait_for(reached, timeout_s)

    def position(self) -> FeedPosition | None:
        with self._lock:
            return self._index.position if self._index is not None else None

    # --- the read side of PrefixIndex ------------------------------------------------------
    def match(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        with self._lock:
            if self._index is None:
                raise StoreUnavailable("the index mirror has not read the index yet (Redis did not answer); "
                                       "routing by load until it does")
            return self._index.match(block_hashes, self._leases, self._clock())

    def worker_hashes(self, worker_id: str) -> set[BlockHash]:
        with self._lock:
            return self._index.worker_hashes(worker_id) if self._index is not None else set()

    def live_workers(self) -> dict[str, int]:
        with self._lock:
            return self._leases.live(self._clock())

    # --- the feed thread -------------------------------------------------------------------
    def _follow_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._step()
            except StoreUnavailable as e:
                self._set_status(MirrorStatus.UNREACHABLE, str(e))
                self._stop.wait(self.config.retry_s)
            except Exception:  # NOTE: a dead feed thread would freeze the router's view for good
                log.exception("index mirror: following the feed failed; re-reading the index")
                self._snapshot_wanted = True
                self._stop.wait(self.config.retry_s)

    def _step(self) -> None:
        if (self._index is None or self._snapshot_wanted
                or self._clock() - self._snapshot_at >= self.config.resnapshot_s):
            self._snapshot()
        self._follow(self._read_events())
        if self._clock() >= self._next_check:
            self._check_store()
        if self._index is not None and not self._snapshot_wanted:
            self._set_status(MirrorStatus.FOLLOWING, "")

    def _read_events(self) -> list[FeedEvent]:
        assert self._index is not None  # _step took a snapshot first
        after = format_stream_id(self._index.position.stream_id)
        block_ms = milliseconds(self.config.block_s)
        with store_errors("reading the index feed"):
            reply = self._client.xread({self._keys.feed: after}, count=self.config.batch, block=block_ms)
        events = []
        for _stream, entries in reply or ():
            for stream_id, fields in entries:
                try:
                    events.append(decode_event(stream_id, fields))
                except MalformedEvent as bad:
                    log.warning("index mirror: %s; re-reading the index", bad)
                    self._snapshot_wanted = True
                    break
        return events

    def _follow(self, events: list[FeedEvent]) -> None:
        if not events:
            return
        with self._lock:
            assert self._index is not None
            expected = self._index.position.seq + 1
            gap = self._index.follow(events)
            self._lock.notify_all()
        if gap is not None:
            log.info("index mirror: the feed skipped from seq %d to %d (events lost: trimmed, Redis "
                     "restarted or the counter was reset); re-reading the index", expected, gap.seq)
            self._snapshot_wanted = True

    def _check_store(self) -> None:
        self._next_check = self._clock() + self.config.check_s
        state = self._read_state()
        self._take_leases(state.leases)
        with self._lock:
            mine = self._index.position if self._index is not None else None
        if mine is not None and needs_snapshot(mine, state.position):
            log.info("index mirror: the feed's counter is at %d, the mirror at %d, with no event between; "
                     "re-reading the index", state.position.seq, mine.seq)
            self._snapshot_wanted = True

    # --- reading Redis ---------------------------------------------------------------------
    def _snapshot(self) -> None:
        state = self._read_state()
        k = self._keys
        with store_errors("reading the index for the mirror"):
            members = list(self._client.smembers(k.entries))
            pipe = self._client.pipeline(transaction=False)
            for m in members:
                pipe.smembers(k.entry_hashes(m.decode(errors="replace")))
            held = pipe.execute()
        entries: dict[WorkerKey, set[BlockHash]] = {}
        for member, hashes in zip(members, held):
            try:
                entries[parse_entry_member(member)] = hashes
            except ValueError as bad:  # UnicodeDecodeError is one
                self._malformed.skip(f"{k.entries} member {member!r}", bad)
        index = FollowedIndex.from_snapshot(state.position, entries)
        self._take_leases(state.leases)
        with self._lock:
            self._index = index
            self._snapshot_wanted, self._snapshot_at = False, self._clock()
            self.snapshots += 1
            self._lock.notify_all()
        log.debug("index mirror: read %d entries at feed seq %d", len(entries), state.position.seq)

    def _read_state(self) -> _StoreState:
        k, read_at = self._keys, self._clock()
        with store_errors("reading the index feed's position and the leases"):
            flat = self._state_script(keys=[k.feed_seq, k.feed, k.workers],
                                      args=[k.live_prefix, milliseconds(RETAIN_S)])
        position = FeedPosition(parse_stream_id(flat[1]) if flat[1] else STREAM_START, int(flat[0]))
        leases = {}
        for i in range(2, len(flat), 3):
            try:
                pttl_ms = int(flat[i + 2])
                until = read_at + pttl_ms / 1000 if pttl_ms >= 0 else float("inf")
                leases[flat[i].decode()] = (int(flat[i + 1]), until)
            except ValueError as bad:  # UnicodeDecodeError is one
                self._malformed.skip(f"{k.live_prefix}{flat[i]!r}", bad)
        return _StoreState(position, LeaseView(leases, read_at))

    def _take_leases(self, leases: LeaseView) -> None:
        """NOTE: the newest read wins, not the last to finish: sync() on a caller's thread and the feed
        thread read concurrently, and an older view must never replace a newer one."""
        with self._lock:
            if leases.read_at >= self._leases.read_at:
                self._leases = leases

    def _set_status(self, status: MirrorStatus, why: str) -> None:
        if status is self._status:
            return
        previous, self._status = self._status, status
        if status is MirrorStatus.UNREACHABLE:
            log.warning("index mirror: Redis does not answer (%s); serving the last index, each worker "
                        "counting until its lease would run out", why)
        elif previous is MirrorStatus.UNREACHABLE:
            log.info("index mirror: Redis answers again; following the feed")
