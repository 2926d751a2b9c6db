"""WorkerRegistry: who serves, where, and how busy, in Redis next to the prefix index.

A worker's life, as the registry sees it:

    epoch = next_epoch(id)          # INCR; also ends any previous incarnation's lease
    register(info, ttl)             # lease + info; raises if a newer epoch exists
    heartbeat(info, ttl, load) ...  # every ~ttl/3; Lease.SUPERSEDED means: shut down
    deregister(id)                  # or just stop: the lease expires after ttl
    forget_departed()               # the router, now and then: drop ids whose lease is gone

The lease is the index's lease (same key), so a worker the router may pick is exactly a
worker whose prefix entries count. heartbeat() rewrites the info when it is missing, so after
Redis restarts empty the next heartbeat puts every running worker back. The info and load
hashes expire with the lease; the epoch counter lives EPOCH_RETAIN_S longer
(pdserve/index/redis_layout.py). A malformed info hash is skipped with a warning naming its
key, so one bad entry never hides the good ones.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, fields
from typing import TYPE_CHECKING

import redis

from pdserve.engine.config import KV_DTYPES
from pdserve.engine.events import Tier
from pdserve.engine.hashing import HASH_BYTES
from pdserve.index.base import Lease, StoreUnavailable, WorkerKey, check_ttl
from pdserve.index.redis_layout import (
    LeaseScripts,
    MalformedKeys,
    RedisKeys,
    milliseconds,
    require_bytes_client,
    store_errors,
)
from pdserve.roles import ROLES, Role

if TYPE_CHECKING:
    from pdserve.engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)

_INT_FIELDS = ("block_size", "num_blocks", "epoch", "lower_tier_blocks")

# KEYS: the workers set. ARGV: the lease key prefix. Removes every worker id whose lease is gone;
# returns how many. Atomic, so a worker renewing its lease meanwhile is never dropped.
FORGET_DEPARTED_LUA = """
local gone = 0
for _, w in ipairs(redis.call("SMEMBERS", KEYS[1])) do
  if redis.call("EXISTS", ARGV[1] .. w) == 0 then
    redis.call("SREM", KEYS[1], w)
    gone = gone + 1
  end
end
return gone
"""


@dataclass(frozen=True)
class WorkerInfo:
    """A worker's registry entry. It carries how the worker hashes its blocks (block size, KV dtype,
    and the engine salt they make with the model's fingerprint), so the router hashes a prompt as
    each worker does and never re-derives a salt from settings of its own."""

    worker_id: str
    role: Role
    address: str  # host:port of its gRPC server: every service it serves
    node: str
    model_fingerprint: str
    block_size: int
    kv_dtype: str
    salt: str  # hex of its engine salt (pdserve/engine/hashing.py engine_salt): keys its block hashes
    num_blocks: int
    epoch: int
    # Blocks its tiers below the device pool hold (host and disk: engine/host_tier.py); 0 = none, and
    # the router then asks the index for no lower-tier keys of it (router/scoring.py held_by_tier).
    lower_tier_blocks: int = 0

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"worker {self.worker_id!r} has role {self.role!r}; use one of {ROLES}")
        if self.block_size <= 0 or self.num_blocks <= 0:
            raise ValueError(f"worker {self.worker_id!r} reports block_size={self.block_size}, "
                             f"num_blocks={self.num_blocks}; both must be positive")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"worker {self.worker_id!r} reports kv_dtype {self.kv_dtype!r}; known: "
                             f"{', '.join(KV_DTYPES)}")
        if not _is_salt_hex(self.salt):
            raise ValueError(f"worker {self.worker_id!r} reports salt {self.salt!r}; expected the hex of "
                             f"{HASH_BYTES} bytes")

    @classmethod
    def of_engine(cls, engine: LLMEngine, worker_id: str, role: Role, address: str, node: str,
                  epoch: int) -> WorkerInfo:
        """The entry of a worker serving `engine`: its hashing and pool as the engine has them."""
        lower = sum(t.capacity_blocks for t in engine.pool.tier_usage() if t.tier is not Tier.DEVICE)
        return cls(worker_id, role, address, node, engine.fingerprint, engine.block_size,
                   engine.config.cache.kv_dtype, engine.salt.hex(), engine.pool.num_blocks, epoch, lower)

    @property
    def key(self) -> WorkerKey:
        return WorkerKey(self.worker_id, self.epoch)

    def to_fields(self) -> dict[str, str]:
        return {name: str(value) for name, value in asdict(self).items()}

    @classmethod
    def from_fields(cls, raw: Mapping[bytes, bytes]) -> WorkerInfo:
        text = {k.decode(): v.decode() for k, v in raw.items()}
        # A field with a default may be absent: an older worker's entry, mid rolling upgrade.
        missing = [f.name for f in fields(cls) if f.name not in text and f.default is MISSING]
        if missing:
            raise ValueError(f"worker info in Redis lacks {missing}; was it written by another version?")
        values: dict[str, object] = {f.name: text[f.name] for f in fields(cls) if f.name in text}
        for name in _INT_FIELDS:
            if name in values:
                values[name] = int(text[name])
        return cls(**values)  # type: ignore[arg-type]


def _is_salt_hex(text: str) -> bool:
    try:
        return len(bytes.fromhex(text)) == HASH_BYTES
    except ValueError:
        return False


class StaleEpoch(ValueError):
    """A worker tried to register with an epoch older than the newest one handed out."""


class WorkerRegistry:
    def __init__(self, client: redis.Redis, namespace: str = "pdserve") -> None:
        require_bytes_client(client)
        self._client = client
        self._keys = RedisKeys(namespace)
        self._leases = LeaseScripts(client, self._keys)
        self._forget_departed = client.register_script(FORGET_DEPARTED_LUA)
        self._malformed = MalformedKeys()

    def next_epoch(self, worker_id: str) -> int:
        """A fresh epoch for a (re)starting worker, higher than any before; ends the old lease."""
        return self._leases.next_epoch(worker_id)

    def register(self, info: WorkerInfo, ttl_s: float) -> Lease:
        lease = self._leases.set_live(info.key, ttl_s, info.to_fields())
        if lease is Lease.SUPERSEDED:
            raise StaleEpoch(f"worker {info.worker_id!r} registered with epoch {info.epoch}, but a "
                             "newer epoch exists; take a fresh one with next_epoch() and register again")
        return lease

    def heartbeat(self, info: WorkerInfo, ttl_s: float,
                  load: Mapping[str, int] | None = None) -> Lease:
        """Renew the lease (and info); store load numbers such as active requests and used blocks.

        The load expires with the lease: load_of() is {} for a worker that stopped reporting it.
        """
        lease = self._leases.set_live(info.key, ttl_s, info.to_fields())
        if lease is not Lease.SUPERSEDED and load is not None:
            try:
                self._write_load(info.worker_id, ttl_s, load)
            except StoreUnavailable as e:  # NOTE: the lease was renewed; say so, load is only a hint
                log.debug("load of %s not written: %s", info.worker_id, e)
        return lease

    def live_workers(self) -> list[WorkerInfo]:
        """Workers holding a lease, whose info was written by the incarnation holding it."""
        k = self._keys
        with store_errors("live_workers()"):
            ids = sorted(self._client.smembers(k.workers))
            pipe = self._client.pipeline(transaction=False)
            for w in ids:
                pipe.get(k.live_prefix.encode() + w)
                pipe.hgetall(k.info_prefix.encode() + w)
            replies = pipe.execute()
        live = []
        for w, epoch, raw in zip(ids, replies[0::2], replies[1::2]):
            if epoch is None or not raw:
                continue
            info = self._parse_info(w, raw)
            if info is not None and str(info.epoch).encode() == epoch:
                live.append(info)
        return live

    def _parse_info(self, worker_id: bytes, raw: Mapping[bytes, bytes]) -> WorkerInfo | None:
        key = f"{self._keys.info_prefix}{worker_id.decode(errors='backslashreplace')}"
        try:
            info = WorkerInfo.from_fields(raw)
        except (ValueError, TypeError) as e:  # UnicodeDecodeError is a ValueError
            self._malformed.skip(key, e)
            return None
        if info.worker_id.encode() != worker_id:
            self._malformed.skip(key, f"it names worker {info.worker_id!r}")
            return None
        return info

    def load_of(self, worker_id: str) -> dict[str, int]:
        key = self._keys.load(worker_id)
        with store_errors(f"load_of({worker_id!r})"):
            raw = self._client.hgetall(key)
        load = {}
        for name, value in raw.items():
            try:
                load[name.decode()] = int(value)
            except ValueError as e:
                self._malformed.skip(f"{key} field {name!r}", e)
        return load

    def forget_departed(self) -> int:
        """Drop from the workers set every id whose lease is gone (it comes back with its next lease)."""
        k = self._keys
        with store_errors("forget_departed()"):
            return int(self._forget_departed(keys=[k.workers], args=[k.live_prefix]))

    def deregister(self, worker_id: str) -> None:
        """Take the worker out now (its epoch counter stays, so a restart still gets a higher one)."""
        k = self._keys
        with store_errors(f"deregister({worker_id!r})"):
            pipe = self._client.pipeline(transaction=False)
            pipe.delete(k.live(worker_id), k.info(worker_id), k.load(worker_id))
            pipe.srem(k.workers, worker_id)
            pipe.execute()

    def _write_load(self, worker_id: str, ttl_s: float, load: Mapping[str, int]) -> None:
        check_ttl(ttl_s)
        key = self._keys.load(worker_id)
        with store_errors(f"the load of {worker_id!r}"):
            pipe = self._client.pipeline(transaction=True)
            pipe.delete(key)
            if load:
                pipe.hset(key, mapping={name: int(n) for name, n in load.items()})
                pipe.pexpire(key, milliseconds(ttl_s))
            pipe.execute()
