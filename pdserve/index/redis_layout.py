"""The Redis key layout shared by RedisPrefixIndex and WorkerRegistry, and the lease script.

Both use the same lease key (`{ns}:live:{worker_id}`), so "live" means one thing for
routing and for prefix matching. The layout is described in pdserve/index/__init__.py.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import redis

from pdserve.index.base import Lease, StoreUnavailable, WorkerKey, check_ttl

_ENTRY = re.compile(r"^(.+)@(\d+)$")

# KEYS: epoch counter, lease, workers set, info hash
# ARGV: worker_id, epoch, ttl_ms, then optional info field/value pairs (replace the info hash)
# Returns 0 superseded, 1 renewed, 2 started.
# NOTE: the counter is raised to the epoch seen, so after Redis loses its data (a restart
# without persistence) the first heartbeat restores it and next_epoch() stays monotonic.
LEASE_LUA = """
local current = tonumber(redis.call("GET", KEYS[1]) or "0")
if tonumber(ARGV[2]) < current then return 0 end
if tonumber(ARGV[2]) > current then redis.call("SET", KEYS[1], ARGV[2]) end
local held = redis.call("GET", KEYS[2])
redis.call("SET", KEYS[2], ARGV[2], "PX", ARGV[3])
redis.call("SADD", KEYS[3], ARGV[1])
if #ARGV > 3 then
  redis.call("DEL", KEYS[4])
  redis.call("HSET", KEYS[4], unpack(ARGV, 4))
end
if held == ARGV[2] then return 1 end
return 2
"""

# KEYS: epoch counter, lease. A new epoch ends the previous incarnation's lease at once.
NEXT_EPOCH_LUA = """
local epoch = redis.call("INCR", KEYS[1])
redis.call("DEL", KEYS[2])
return epoch
"""

_LEASE_RESULT = {0: Lease.SUPERSEDED, 1: Lease.RENEWED, 2: Lease.STARTED}


@dataclass(frozen=True)
class RedisKeys:
    namespace: str = "pdserve"

    @property
    def block_prefix(self) -> bytes:
        return f"{self.namespace}:blk:".encode()

    def block(self, block_hash: bytes) -> bytes:
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

    def info(self, worker_id: str) -> str:
        return f"{self.namespace}:info:{worker_id}"

    def load(self, worker_id: str) -> str:
        return f"{self.namespace}:load:{worker_id}"


def entry_member(worker: WorkerKey) -> str:
    """How a worker-epoch is named inside block sets: 'worker_id@epoch'."""
    return f"{worker.worker_id}@{worker.epoch}"


def parse_entry_member(member: bytes | str) -> WorkerKey:
    text = member.decode() if isinstance(member, bytes) else member
    found = _ENTRY.match(text)
    if found is None:
        raise ValueError(f"{text!r} is not a 'worker_id@epoch' index entry; was the namespace shared?")
    return WorkerKey(found.group(1), int(found.group(2)))


def require_bytes_client(client: redis.Redis) -> None:
    if client.get_connection_kwargs().get("decode_responses"):
        raise ValueError("the Redis client decodes responses, but block hashes are raw bytes; "
                         "create it with decode_responses=False (the default)")


@contextlib.contextmanager
def store_errors(what: str) -> Iterator[None]:
    """Turn connection-level Redis failures into StoreUnavailable, naming the operation."""
    try:
        yield
    except (redis.ConnectionError, redis.TimeoutError) as e:
        raise StoreUnavailable(f"Redis did not answer during {what}: {e}. Check that the server "
                               "at --redis-url is running and reachable") from e


class LeaseScripts:
    """The two scripts every lease holder needs, registered once per client."""

    def __init__(self, client: redis.Redis, keys: RedisKeys) -> None:
        self._keys = keys
        self._lease = client.register_script(LEASE_LUA)
        self._next_epoch = client.register_script(NEXT_EPOCH_LUA)

    def set_live(self, worker: WorkerKey, ttl_s: float,
                 info: Mapping[str, str] | None = None) -> Lease:
        check_ttl(ttl_s)
        k = self._keys
        args: list[str | int] = [worker.worker_id, worker.epoch, max(1, round(ttl_s * 1000))]
        for field, value in (info or {}).items():
            args += [field, value]
        keys = [k.epoch(worker.worker_id), k.live(worker.worker_id), k.workers, k.info(worker.worker_id)]
        with store_errors(f"the lease of {entry_member(worker)}"):
            return _LEASE_RESULT[int(self._lease(keys=keys, args=args))]

    def next_epoch(self, worker_id: str) -> int:
        keys = [self._keys.epoch(worker_id), self._keys.live(worker_id)]
        with store_errors(f"next_epoch({worker_id!r})"):
            return int(self._next_epoch(keys=keys))
