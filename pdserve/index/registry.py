"""WorkerRegistry: who serves, where, and how busy, in Redis next to the prefix index.

A worker's life, as the registry sees it:

    epoch = next_epoch(id)          # INCR; also ends any previous incarnation's lease
    register(info, ttl)             # lease + info; raises if a newer epoch exists
    heartbeat(info, ttl, load) ...  # every ~ttl/3; Lease.SUPERSEDED means: shut down
    deregister(id)                  # or just stop: the lease expires after ttl

The lease is the index's lease (same key), so a worker the router may pick is exactly a
worker whose prefix entries count. heartbeat() rewrites the info too, so after Redis
restarts empty the next heartbeat puts every running worker back.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Literal

import redis

from pdserve.index.base import Lease, WorkerKey, check_ttl
from pdserve.index.redis_layout import LeaseScripts, RedisKeys, require_bytes_client, store_errors

Role = Literal["prefill", "decode"]
ROLES: tuple[Role, ...] = ("prefill", "decode")
_INT_FIELDS = ("block_size", "num_blocks", "epoch")


@dataclass(frozen=True)
class WorkerInfo:
    worker_id: str
    role: Role
    address: str  # host:port of its Worker gRPC service
    kv_address: str  # host:port of its KVTransfer service (may equal address)
    node: str
    model_fingerprint: str
    block_size: int
    num_blocks: int
    epoch: int

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"worker {self.worker_id!r} has role {self.role!r}; use one of {ROLES}")
        if self.block_size <= 0 or self.num_blocks <= 0:
            raise ValueError(f"worker {self.worker_id!r} reports block_size={self.block_size}, "
                             f"num_blocks={self.num_blocks}; both must be positive")

    @property
    def key(self) -> WorkerKey:
        return WorkerKey(self.worker_id, self.epoch)

    def to_fields(self) -> dict[str, str]:
        return {name: str(value) for name, value in asdict(self).items()}

    @classmethod
    def from_fields(cls, raw: Mapping[bytes, bytes]) -> WorkerInfo:
        text = {k.decode(): v.decode() for k, v in raw.items()}
        missing = [f.name for f in fields(cls) if f.name not in text]
        if missing:
            raise ValueError(f"worker info in Redis lacks {missing}; was it written by another version?")
        values: dict[str, object] = {f.name: text[f.name] for f in fields(cls)}
        for name in _INT_FIELDS:
            values[name] = int(text[name])
        return cls(**values)  # type: ignore[arg-type]


class StaleEpoch(ValueError):
    """A worker tried to register with an epoch older than the newest one handed out."""


class WorkerRegistry:
    def __init__(self, client: redis.Redis, namespace: str = "pdserve") -> None:
        require_bytes_client(client)
        self._client = client
        self._keys = RedisKeys(namespace)
        self._leases = LeaseScripts(client, self._keys)

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
            self._write_load(info.worker_id, ttl_s, load)
        return lease

    def live_workers(self) -> list[WorkerInfo]:
        """Workers holding a lease, whose info was written by the incarnation holding it."""
        k = self._keys
        with store_errors("live_workers()"):
            ids = sorted(m.decode() for m in self._client.smembers(k.workers))
            pipe = self._client.pipeline(transaction=False)
            for w in ids:
                pipe.get(k.live(w))
                pipe.hgetall(k.info(w))
            replies = pipe.execute()
        live = []
        for epoch, raw in zip(replies[0::2], replies[1::2]):
            if epoch is not None and raw:
                info = WorkerInfo.from_fields(raw)
                if info.epoch == int(epoch):
                    live.append(info)
        return live

    def load_of(self, worker_id: str) -> dict[str, int]:
        with store_errors(f"load_of({worker_id!r})"):
            raw = self._client.hgetall(self._keys.load(worker_id))
        return {k.decode(): int(v) for k, v in raw.items()}

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
                pipe.pexpire(key, max(1, round(ttl_s * 1000)))
            pipe.execute()
