"""The Redis key layout shared by RedisPrefixIndex and WorkerRegistry, the lease script, and how
long each key lives.

Both use the same lease key (`{ns}:live:{worker_id}`), so "live" means one thing for
routing and for prefix matching. The layout is described in pdserve/index/__init__.py.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import redis

from pdserve.engine.hashing import BlockHash
from pdserve.index.base import (  # noqa: F401 (entry names: re-exported for the Redis users)
    Lease,
    StoreUnavailable,
    WorkerKey,
    check_ttl,
    entry_member,
    parse_entry_member,
)
from pdserve.index.feed import FEED_VERSION

log = logging.getLogger(__name__)

# How long what a worker leaves in Redis survives it (its entry's hash set, the block sets it is in,
# the namespace's `workers` and `entries` sets): every write of the worker renews it, and so does
# its heartbeat (the lease, the entry's hash set) and its publisher's rolling touch (the block sets,
# redis_index.TOUCH_LUA). A live worker never lets them lapse; the router's sweep deletes a departed
# worker's entries within seconds; this TTL is the backstop when nothing sweeps (every router and
# worker of a namespace gone), and how long a Redis refusing writes may last before a worker's index
# entries expire (it republishes them when its lease comes back).
RETAIN_S = 600.0
# How long a worker's epoch counter survives the worker's last lease renewal.
# NOTE: an expiring counter must never hand out an epoch at or below one an incarnation still uses
# (that incarnation would take the lease back, and its old entries would count again). So a counter
# that does not exist is seeded from the Redis server's clock in microseconds before INCR: a worker
# restarting after its counter expired (or after Redis lost its data) gets an epoch above every
# earlier one, as long as it restarted fewer than a million times a second on average since the
# counter was seeded and Redis's clock does not go back. Epochs are therefore 16-digit numbers, not
# 1, 2, 3 (exact in Lua's doubles, which hold integers up to 2^53, until the year 2255).
EPOCH_RETAIN_S = 86_400.0

# KEYS: epoch counter, lease, workers set, info hash, the entry's hash set
# ARGV: worker_id, epoch, lease ttl_ms, RETAIN ms, EPOCH_RETAIN ms, then optional info field/value
# pairs. Returns 0 superseded, 1 renewed, 2 started.
# NOTE: a renewal only moves expiry times (PEXPIRE), which Redis allows even when it is out of memory
# and refuses other writes, so a worker's lease outlives a full Redis. The counter is raised to the
# epoch seen, so after Redis loses its data the first heartbeat restores it.
LEASE_LUA = """
local epoch, current = tonumber(ARGV[2]), tonumber(redis.call("GET", KEYS[1]) or "0")
if epoch < current then return 0 end
if epoch > current then redis.call("SET", KEYS[1], ARGV[2], "PX", ARGV[5])
else redis.call("PEXPIRE", KEYS[1], ARGV[5]) end
local renewed = redis.call("GET", KEYS[2]) == ARGV[2]
if renewed then redis.call("PEXPIRE", KEYS[2], ARGV[3])
else redis.call("SET", KEYS[2], ARGV[2], "PX", ARGV[3]) end
if redis.call("SISMEMBER", KEYS[3], ARGV[1]) == 0 then redis.call("SADD", KEYS[3], ARGV[1]) end
redis.call("PEXPIRE", KEYS[3], ARGV[4])
if #ARGV > 5 and (not renewed or redis.call("EXISTS", KEYS[4]) == 0) then
  redis.call("DEL", KEYS[4])
  redis.call("HSET", KEYS[4], unpack(ARGV, 6))
end
redis.call("PEXPIRE", KEYS[4], ARGV[3])
redis.call("PEXPIRE", KEYS[5], ARGV[4])
if renewed then return 1 end
return 2
"""

# Lua: if the counter KEYS[n] is missing, seed it from the server's clock in microseconds, so that a
# counter that expired or was lost only ever comes back higher (see EPOCH_RETAIN_S).
SEED_FROM_CLOCK_LUA = """
local function seed_from_clock(key)
  if redis.call("EXISTS", key) == 0 then
    local now = redis.call("TIME")
    redis.call("SET", key, now[1] .. string.format("%06d", tonumber(now[2])))
  end
end
"""

# KEYS: epoch counter, lease. ARGV: EPOCH_RETAIN ms. A new epoch ends the previous incarnation's
# lease at once. A missing counter is seeded from the server's clock (see EPOCH_RETAIN_S).
NEXT_EPOCH_LUA = SEED_FROM_CLOCK_LUA + """
seed_from_clock(KEYS[1])
local epoch = redis.call("INCR", KEYS[1])
redis.call("PEXPIRE", KEYS[1], ARGV[1])
redis.call("DEL", KEYS[2])
return epoch
"""

# The index's change feed (what the router's mirror follows: pdserve/index/mirror.py). Every script
# that changes an entry's hashes (APPLY_LUA, DROP_LUA) ends with publish_feed(), in the same script,
# so the feed and the sets never disagree. Each stream entry carries the next value of the feed's
# sequence counter: a reader that sees a number other than its last + 1 knows it lost events.
# Stream fields: v (feed.py FEED_VERSION), seq, op ("apply" or "drop"), entry ('worker_id@epoch'), stored and
# removed (the raw hashes, HASH_BYTES each, concatenated; removed after stored, as apply() does).
# NOTE: MAXLEN ~ keeps the stream near FEED_MAXLEN entries (about a minute of a busy cluster's
# batches): a reader further behind than that sees a gap and re-reads the index instead.
# The counter is seeded from the clock, like an epoch: if it expires (RETAIN_S without a write) or
# Redis loses it, it comes back higher than any value it had, and every reader sees a gap.
FEED_MAXLEN = 10_000
PUBLISH_FEED_LUA = SEED_FROM_CLOCK_LUA + f"""
local function publish_feed(feed, counter, retain, op, member, stored, removed)
  seed_from_clock(counter)
  local seq = redis.call("INCR", counter)
  redis.call("PEXPIRE", counter, retain)
  redis.call("XADD", feed, "MAXLEN", "~", "{FEED_MAXLEN}", "*", "v", "{FEED_VERSION.decode()}",
             "seq", string.format("%d", seq), "op", op, "entry", member, "stored", stored, "removed", removed)
  redis.call("PEXPIRE", feed, retain)
end
"""

_LEASE_RESULT = {0: Lease.SUPERSEDED, 1: Lease.RENEWED, 2: Lease.STARTED}


@dataclass(frozen=True)
class RedisKeys:
    namespace: str = "pdserve"

    @property
    def block_prefix(self) -> bytes:
        return f"{self.namespace}:blk:".encode()

    def block(self, block_hash: BlockHash) -> bytes:
        return self.block_prefix + block_hash

    def entry_hashes(self, member: str) -> str:
        return f"{self.namespace}:wh:{member}"

    @property
    def entries(self) -> str:
        return f"{self.namespace}:entries"

    @property
    def workers(self) -> str:
        return f"{self.namespace}:workers"

    @property
    def live_prefix(self) -> str:
        return f"{self.namespace}:live:"

    def live(self, worker_id: str) -> str:
        return self.live_prefix + worker_id

    def epoch(self, worker_id: str) -> str:
        return f"{self.namespace}:epoch:{worker_id}"

    @property
    def info_prefix(self) -> str:
        return f"{self.namespace}:info:"

    def info(self, worker_id: str) -> str:
        return self.info_prefix + worker_id

    def load(self, worker_id: str) -> str:
        return f"{self.namespace}:load:{worker_id}"

    @property
    def feed(self) -> str:
        return f"{self.namespace}:feed"

    @property
    def feed_seq(self) -> str:
        return f"{self.namespace}:feed:seq"


def require_bytes_client(client: redis.Redis) -> None:
    if client.get_connection_kwargs().get("decode_responses"):
        raise ValueError("the Redis client decodes responses, but block hashes are raw bytes; "
                         "create it with decode_responses=False (the default)")


def milliseconds(seconds: float) -> int:
    return max(1, round(seconds * 1000))


@contextlib.contextmanager
def store_errors(what: str) -> Iterator[None]:
    """Turn every Redis failure into StoreUnavailable, naming the operation.

    NOTE: not only a Redis that does not answer: one that answers with an error (OOM when full,
    READONLY as a replica, NOPERM for an ACL user without the command, a script error on data
    someone else wrote) leaves the index just as unusable, and callers degrade the same way.
    """
    try:
        yield
    except redis.AuthenticationError as e:
        raise StoreUnavailable(f"Redis refused the credentials during {what}: {e}. Check the user and "
                               "password in --redis-url") from e
    except (redis.ConnectionError, redis.TimeoutError) as e:
        raise StoreUnavailable(f"Redis did not answer during {what}: {e}. Check that the server "
                               "at --redis-url is running and reachable") from e
    except redis.RedisError as e:
        raise StoreUnavailable(f"Redis refused {what}: {e}. Check the server's memory (maxmemory), "
                               "that it is a primary, and the ACL of the user in --redis-url") from e


class MalformedKeys:
    """Skips what cannot be parsed (a hash or member written by something else, or another version),
    warning once per key: the router reads the same keys on every refresh."""

    def __init__(self, limit: int = 1024) -> None:
        self._warned: set[str] = set()
        self._limit = limit

    def skip(self, key: str, problem: object) -> None:
        if key in self._warned:
            return
        if len(self._warned) < self._limit:  # NOTE: bounded: junk keys must not grow our memory
            self._warned.add(key)
        log.warning("skipping malformed Redis key %s: %s (was it written by another version of pdserve, or "
                    "does another application share the namespace? delete it)", key, problem)


class LeaseScripts:
    """The two scripts every lease holder needs, registered once per client."""

    def __init__(self, client: redis.Redis, keys: RedisKeys) -> None:
        self._keys = keys
        self._lease = client.register_script(LEASE_LUA)
        self._next_epoch = client.register_script(NEXT_EPOCH_LUA)

    def set_live(self, worker: WorkerKey, ttl_s: float,
                 info: Mapping[str, str] | None = None) -> Lease:
        check_ttl(ttl_s)
        k, member = self._keys, entry_member(worker)
        args: list[str | int] = [worker.worker_id, worker.epoch, milliseconds(ttl_s), milliseconds(RETAIN_S),
                                 milliseconds(EPOCH_RETAIN_S)]
        for field, value in (info or {}).items():
            args += [field, value]
        keys = [k.epoch(worker.worker_id), k.live(worker.worker_id), k.workers, k.info(worker.worker_id),
                k.entry_hashes(member)]
        with store_errors(f"the lease of {member}"):
            return _LEASE_RESULT[int(self._lease(keys=keys, args=args))]

    def next_epoch(self, worker_id: str) -> int:
        keys = [self._keys.epoch(worker_id), self._keys.live(worker_id)]
        with store_errors(f"next_epoch({worker_id!r})"):
            return int(self._next_epoch(keys=keys, args=[milliseconds(EPOCH_RETAIN_S)]))
