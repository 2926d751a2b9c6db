"""The Ray actor body shared by prefill_worker/ and decode_worker/: each role's actor class
(prefill_worker/actor.py, decode_worker/actor.py) subclasses WorkerActor and says, in role(),
which services its WorkerServer serves.

Ray places the actor (num_gpus=1 on GPU nodes, CPUs otherwise), restarts it when its
process dies (max_restarts), and the constructor does everything a fresh process needs:
load the model, take a new epoch, start the gRPC server, register in Redis. So a
restarted actor comes back on its own, under a higher epoch, and the router never
counts the blocks its previous process published (its index publisher deletes them).

Redis is shared state, not a dependency of serving: the engine hands KV events to the
index publisher's queue and never waits on Redis; the publisher and the heartbeat call
Redis from their own threads, through one circuit breaker, and any Redis error (down,
hung, out of memory, read-only, permission denied) costs prefix hits, never a request.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis
from grpc_health.v1 import health_pb2

from pdserve.engine.config import EngineConfig
from pdserve.index.base import StoreUnavailable, WorkerKey
from pdserve.index.breaker import CircuitBreaker
from pdserve.index.publisher import IndexPublisher
from pdserve.index.redis_index import RedisPrefixIndex
from pdserve.index.registry import WorkerInfo, WorkerRegistry
from pdserve.security import SecurityConfig, TLSFiles
from pdserve.security.redis_auth import redis_exposure_warning
from pdserve.transfer.frames import KVFrames
from pdserve.worker.presence import Presence
from pdserve.worker.scrubber import AuditSchedule
from pdserve.worker.server import Role, WorkerConfig, WorkerServer

WILDCARD_HOSTS = ("0.0.0.0", "::", "")
REDIS_TIMEOUT_S = 1.0  # per Redis call: connect, answer, and wait for the worker's one connection


@dataclass(frozen=True)
class WorkerSpec:
    """Everything an actor needs, as plain values (it crosses a process boundary).

    Security travels as file paths (read on the worker's node, so they must exist there) and
    the cluster secret's value; the actor builds its SecurityConfig itself. The Redis URL (it
    may hold a password) and the secret are left out of repr().
    """

    role: str
    worker_id: str
    redis_url: str = field(repr=False)
    engine: EngineConfig = field(default_factory=EngineConfig)  # the model, KV cache, scheduler, device
    host: str = "127.0.0.1"
    heartbeat_s: float = 1.0
    liveness_ttl_s: float = 5.0
    metrics_port: int | None = 0  # Prometheus /metrics; 0 = any free port, None = off
    redis_wait_s: float = 300.0  # at start: how long to wait for an unreachable Redis
    drain_grace_s: float = 30.0  # on SIGTERM: how long in-flight requests may take to finish
    namespace: str = "pdserve"
    tls: TLSFiles = field(default_factory=TLSFiles)  # plaintext unless it names a certificate
    cluster_secret: str | None = field(default=None, repr=False)  # None: no check
    audit: AuditSchedule = field(default_factory=AuditSchedule)  # the background KV audit; off by default
    kv_frames: KVFrames = field(default_factory=KVFrames)  # a prefill worker's LAYER frame size
    # Debug only (decode_worker/faults.py): a decode worker holds each stream once it has sent this
    # many tokens, until its actor's release_hold(). None, always, in production.
    decode_hold_after_tokens: int | None = None

    def security_config(self) -> SecurityConfig:
        """What the worker serves with (TLS, the cluster secret) and dials decode workers with."""
        return SecurityConfig.of_files(self.tls, cluster_secret=self.cluster_secret)


class WorkerActor:
    """Construct = serve. Methods are what the launcher and tests ask of a running worker."""

    def __init__(self, spec: WorkerSpec) -> None:
        logging.basicConfig(level=logging.INFO,
                            format=f"%(asctime)s {spec.worker_id} %(levelname)s %(message)s")
        self.spec = spec
        log = logging.getLogger(__name__)
        if (warning := redis_exposure_warning(spec.redis_url)) is not None:
            log.warning("%s: %s", spec.worker_id, warning)
        client = redis_client(spec.redis_url)
        self.registry = WorkerRegistry(client, spec.namespace)
        self.index = RedisPrefixIndex(client, spec.namespace)
        self.epoch = _when_redis_answers(lambda: self.registry.next_epoch(spec.worker_id), spec.redis_wait_s,
                                         spec.worker_id)
        breaker = CircuitBreaker()  # one view of Redis's health for the heartbeat and the publisher
        self.publisher = IndexPublisher(self.index, WorkerKey(spec.worker_id, self.epoch), breaker)
        config = WorkerConfig(spec.role, spec.engine, worker_id=spec.worker_id, host=spec.host,
                              advertise_host=_advertise_host(spec.host), node=_node_name(),
                              metrics_port=spec.metrics_port, security=spec.security_config(),
                              audit=spec.audit)
        self.server = WorkerServer(config, self.role(), publisher=self.publisher, epoch=self.epoch,
                                   on_failing=self._leave)
        address = self.server.start()
        self.publisher.start(self._cached_hashes)
        self.info = WorkerInfo.of_engine(self.server.engine, spec.worker_id, spec.role, address, _node_name(),
                                         self.epoch)
        self.presence = Presence(self.registry, self.publisher, self.info, self._load, spec.heartbeat_s,
                                 spec.liveness_ttl_s, breaker)
        self.presence.start()
        _on_sigterm(self._drain_and_exit)

    def role(self) -> Role:
        """The services this worker serves beside the shared ones (each role's actor says)."""
        raise NotImplementedError("construct PrefillWorker or DecodeWorker, not WorkerActor")

    def _leave(self, reason: str) -> None:
        """The engine keeps failing (the server is NOT_SERVING already): leave the registry too, so
        no router or prefill worker sends work here. The process stays for an operator to look at."""
        logging.getLogger(__name__).error("%s leaves the registry: %s", self.spec.worker_id, reason)
        presence = getattr(self, "presence", None)  # None: it failed before it ever registered
        if presence is not None:
            presence.stop(deregister=True)

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

    def steps(self, after: int = 0) -> bytes:
        """The traced engine steps numbered above `after` (a serialized worker_pb2.StepsReply)."""
        assert self.server.servicer is not None, "the worker has not started"
        return self.server.servicer.steps(after).SerializeToString()

    def drain(self, grace_s: float | None = None) -> bool:
        """Leave the registry (the router stops picking this worker within one refresh), refuse new
        requests, and wait for in-flight ones; True when they all finished within the grace."""
        # NOTE: NOT_SERVING before leaving the registry: a router keeps a worker that vanished from
        # the registry while it still answers SERVING (Redis may be refusing its heartbeats).
        self.server.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        self.presence.stop(deregister=True)
        return self.server.drain(self.spec.drain_grace_s if grace_s is None else grace_s)

    def stop(self) -> None:
        self.presence.stop()
        self.server.stop()
        self.publisher.stop()

    def _drain_and_exit(self) -> None:
        finished = self.drain()
        logging.getLogger(__name__).warning("SIGTERM: drained %s (%s); exiting", self.spec.worker_id,
                                            "all requests finished" if finished else "grace period expired")
        self.server.stop()
        os._exit(0)  # NOTE: Ray sees the process end and restarts the actor (max_restarts), new epoch


def redis_client(url: str, timeout_s: float = REDIS_TIMEOUT_S) -> redis.Redis:
    """A client with exactly one connection, which the heartbeat thread and the index publisher's
    thread take in turn (a caller waits at most timeout_s for it, then sees the store as
    unavailable, as it would a Redis that does not answer). One connection, not a pool that grows
    when the two threads happen to overlap: a worker's descriptor count stays fixed (the soak
    judges it), and Redis serves every worker with one connection each."""
    pool = redis.BlockingConnectionPool.from_url(url, max_connections=1, timeout=timeout_s,
                                                 socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    return redis.Redis(connection_pool=pool)


def _when_redis_answers(call: Callable[[], int], wait_s: float, worker_id: str) -> int:
    """call(), retried every second while Redis is unreachable, for at most wait_s.

    NOTE: a worker Ray restarts while Redis is down must not fail its constructor: Ray counts
    each failure as a restart and gives up after max_restarts (the soak found this).
    """
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return call()
        except StoreUnavailable as e:
            if time.monotonic() >= deadline:
                raise
            logging.getLogger(__name__).warning("%s: waiting for Redis to take an epoch: %s", worker_id, e)
            time.sleep(1.0)


def _on_sigterm(drain: Callable[[], None]) -> None:
    """SIGTERM (an operator, Kubernetes, `ray stop`) drains on a thread, then exits."""
    if threading.current_thread() is not threading.main_thread():
        logging.getLogger(__name__).warning("not on the main thread: SIGTERM will not drain this worker")
        return
    signal.signal(signal.SIGTERM,
                  lambda *_: threading.Thread(target=drain, name="drain", daemon=True).start())


def _advertise_host(bind_host: str) -> str | None:
    """A worker bound to every interface is dialled at its node's IP (as Ray knows it)."""
    if bind_host not in WILDCARD_HOSTS:
        return None
    import ray

    if ray.is_initialized():
        return ray.util.get_node_ip_address()
    return socket.gethostbyname(socket.gethostname())


def _node_name() -> str:
    """`host/<Ray node id prefix>` inside Ray, so two raylets on one host stay apart; else the host."""
    import ray

    if not ray.is_initialized():
        return socket.gethostname()
    return f"{socket.gethostname()}/{ray.get_runtime_context().get_node_id()[:8]}"
