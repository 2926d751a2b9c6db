"""The Ray actor body shared by prefill_worker/ and decode_worker/.

Ray places the actor (num_gpus=1 on GPU nodes, CPUs otherwise), restarts it when its
process dies (max_restarts), and the constructor does everything a fresh process needs:
load the model, take a new epoch, start the gRPC server, register in Redis. So a
restarted actor comes back on its own, under a higher epoch, and the router never
counts the blocks its previous process published.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field

import redis

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.index.base import WorkerKey
from pdserve.index.publisher import IndexPublisher
from pdserve.index.redis_index import RedisPrefixIndex
from pdserve.index.registry import WorkerInfo, WorkerRegistry
from pdserve.worker.presence import Presence
from pdserve.worker.server import WorkerConfig, WorkerServer


@dataclass(frozen=True)
class WorkerSpec:
    """Everything an actor needs, as plain values (it crosses a process boundary)."""

    role: str
    worker_id: str
    redis_url: str
    model_path: str | None = None
    host: str = "127.0.0.1"
    block_size: int = 16
    kv_dtype: str = "float32"
    num_blocks: int | None = None
    kv_cache_gib: float = 1.0
    max_num_batched_tokens: int = 2048
    torch_threads: int | None = None
    device: str | None = None
    heartbeat_s: float = 1.0
    liveness_ttl_s: float = 5.0
    namespace: str = "pdserve"
    extra: dict = field(default_factory=dict)

    def engine_config(self) -> EngineConfig:
        cache = CacheConfig(block_size=self.block_size, kv_dtype=self.kv_dtype, num_blocks=self.num_blocks,
                            kv_cache_gib=self.kv_cache_gib)
        return EngineConfig(model_path=self.model_path, cache=cache, device=self.device,
                            scheduler=SchedulerConfig(max_num_batched_tokens=self.max_num_batched_tokens),
                            num_threads=self.torch_threads)


class WorkerActor:
    """Construct = serve. Methods are what the launcher and tests ask of a running worker."""

    def __init__(self, spec: WorkerSpec) -> None:
        logging.basicConfig(level=logging.INFO,
                            format=f"%(asctime)s {spec.worker_id} %(levelname)s %(message)s")
        self.spec = spec
        client = redis.Redis.from_url(spec.redis_url, socket_timeout=1.0, socket_connect_timeout=1.0)
        self.registry = WorkerRegistry(client, spec.namespace)
        self.index = RedisPrefixIndex(client, spec.namespace)
        self.epoch = self.registry.next_epoch(spec.worker_id)
        self.publisher = IndexPublisher(self.index, WorkerKey(spec.worker_id, self.epoch))
        config = WorkerConfig(spec.role, spec.engine_config(), worker_id=spec.worker_id, host=spec.host)
        self.server = WorkerServer(config, publisher=self.publisher, epoch=self.epoch)
        address = self.server.start()
        engine = self.server.engine
        self.info = WorkerInfo(spec.worker_id, spec.role, address, address, socket.gethostname(),
                               engine.fingerprint, engine.block_size, engine.pool.num_blocks, self.epoch)
        self.presence = Presence(self.registry, self.publisher, self.info, self._load,
                                 self._cached_hashes, spec.heartbeat_s, spec.liveness_ttl_s)
        self.presence.start()

    def _load(self) -> dict[str, int]:
        s = self.server.status()
        return {"active": s.active_requests, "waiting": s.waiting_requests, "used_blocks": s.used_blocks,
                "free_blocks": s.free_blocks}

    def _cached_hashes(self) -> list[bytes]:
        with self.server.engine.lock:
            return self.server.engine.pool.cached_hashes()

    # --- asked by the launcher and tests --------------------------------------------------------
    def address(self) -> str:
        return self.info.address

    def describe(self) -> dict:
        return {"worker_id": self.info.worker_id, "role": self.info.role, "address": self.info.address,
                "epoch": self.epoch, "pid": os.getpid(), "node": self.info.node}

    def status(self) -> bytes:
        return self.server.status().SerializeToString()

    def stop(self) -> None:
        self.presence.stop()
        self.server.stop()
