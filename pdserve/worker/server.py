"""WorkerServer: builds one worker (engine, loop, services) and runs its gRPC server.

The Worker, KVTransfer and health services share one port, so a worker has one address.
Ray actors (prefill_worker/, decode_worker/) and tests construct this directly.

Security (config.security, None = plaintext and no checks): Worker and KVTransfer demand
the cluster secret, health stays open, and the port serves TLS when the config has a
certificate. The same config dials decode workers for KV pushes (an internal client).

Limits (refused at once with RESOURCE_EXHAUSTED naming the limit, never queued; see
pdserve/call_limits.py): at most max_concurrent_calls Worker and KVTransfer calls at once
(Status and Abort excepted: they are quick, and Abort frees blocks), set above the router's
per-decode admission limit (router.placement.PlacementConfig.max_in_flight_per_decode) so that
it only ever stops a flood; at most max_health_watches Health.Watch streams; at most
max_pushes_per_peer KV pushes at once from one peer host, and push_time_limit_s from BEGIN to
END for each (pdserve/transfer/grpc_transport.py). The thread pool has a thread for every call
the limits admit plus SPARE_THREADS. Connections follow config.connections (keepalive, ping
policy, idle and age limits: pdserve/grpc_options.py).
"""

from __future__ import annotations

import logging
import socket
import time
import uuid
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.call_limits import CallLimit, CallLimiter, health_watch_limit, method_paths, service_prefix
from pdserve.engine.audit import KVAuditor
from pdserve.engine.config import EngineConfig
from pdserve.engine.events import KVEventPublisher
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.weights import LoadedModel, load_model
from pdserve.grpc_options import ConnectionPolicy, server_options
from pdserve.kvwire import KVLayout
from pdserve.metrics import MetricsEndpoint
from pdserve.security import SecurityConfig
from pdserve.transfer.faults import FaultInjector, FaultPlan
from pdserve.transfer.grpc_transport import (
    DEFAULT_MAX_PUSHES_PER_PEER,
    DEFAULT_PUSH_TIME_LIMIT_S,
    GrpcKVChannel,
    KVTransferServicer,
)
from pdserve.transfer.receiver import KVReceiver
from pdserve.transfer.sender import KVChannel, LayerwiseSender
from pdserve.worker.engine_loop import EngineLoop
from pdserve.worker.metrics import WorkerMetrics
from pdserve.worker.peers import DecodeTargets
from pdserve.worker.scrubber import DEFAULT_MAX_FRACTION, check_scrubber_settings, scrubber_for
from pdserve.worker.service import WorkerServicer
from protos.pdserve.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc, worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode")
SPARE_THREADS = 16  # beyond the limited calls: Status, Abort, Health.Check, and refusing extra calls


@dataclass(frozen=True)
class WorkerConfig:
    role: str
    engine: EngineConfig = field(default_factory=EngineConfig)
    worker_id: str = ""  # "" -> role + random suffix
    host: str = "127.0.0.1"  # the address to bind
    port: int = 0
    advertise_host: str | None = None  # what others dial (registry, transfers); None: host
    node: str = field(default_factory=socket.gethostname)
    max_chunk_bytes: int = 2 << 20
    parked_ttl_s: float = 30.0
    transfer_timeout_s: float | None = None  # cap on one KV push; None: the Prefill call's remaining time
    # Engine steps that may fail in a row before the worker takes itself out of service (health
    # NOT_SERVING, every call UNAVAILABLE, and out of the registry on a Ray worker).
    max_failed_steps: int = 3
    # Worker and KVTransfer calls at once (Status, Abort excepted); above the router's per-decode
    # admission limit (64 by default), so a router alone never meets it.
    max_concurrent_calls: int = 256
    max_health_watches: int = 16
    max_pushes_per_peer: int = DEFAULT_MAX_PUSHES_PER_PEER  # incoming KV pushes at once from one peer host
    # An incoming KV push must reach END within this, whatever deadline its sender set. NOTE: a push
    # starts with its prefill (layers stream as computed), so this covers a long prompt's prefill.
    push_time_limit_s: float = DEFAULT_PUSH_TIME_LIMIT_S
    # The server's keepalive, ping policy, idle and age limits; the KV channels it dials use its keepalive.
    connections: ConnectionPolicy = field(default_factory=ConnectionPolicy)
    metrics_port: int | None = 0  # Prometheus /metrics on host:port; 0 = any free port, None = off
    # Debug only: inject faults into this worker's outgoing KV transfers (pdserve/transfer/faults.py).
    # Set only by code that builds the config; nothing reads it from the environment.
    fault_plan: FaultPlan | None = None
    security: SecurityConfig | None = None  # None: plaintext, no cluster secret
    audit_interval_s: float | None = None  # background KV audit every so often; None: off (scrubber.py)
    audit_max_fraction: float = DEFAULT_MAX_FRACTION  # of wall time the background audit may take

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        check_scrubber_settings(self.audit_interval_s, self.audit_max_fraction)
        if self.transfer_timeout_s is not None and self.transfer_timeout_s <= 0:
            raise ValueError(f"transfer_timeout_s must be > 0 seconds (None: the Prefill call's deadline), "
                             f"got {self.transfer_timeout_s}")
        if self.max_failed_steps < 1:
            raise ValueError(f"max_failed_steps must be >= 1, got {self.max_failed_steps}")
        for name in ("max_concurrent_calls", "max_health_watches", "max_pushes_per_peer"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.push_time_limit_s > 0:
            raise ValueError(f"push_time_limit_s must be > 0 seconds, got {self.push_time_limit_s}")
        if not self.worker_id:
            object.__setattr__(self, "worker_id", f"{self.role}-{uuid.uuid4().hex[:8]}")


class WorkerServer:
    def __init__(self, config: WorkerConfig, loaded: LoadedModel | None = None,
                 publisher: KVEventPublisher | None = None, epoch: int = 0, *,
                 dial: Callable[[str], KVChannel] | None = None,
                 fault_sleep: Callable[[float], None] = time.sleep,
                 on_failing: Callable[[str], None] | None = None,
                 decode_targets: DecodeTargets | None = None) -> None:
        """dial: how KV channels to decode workers are made (None: gRPC with config.security).
        fault_sleep: what a DELAY fault of config.fault_plan waits with (a test holds a transfer
        on an event with it). on_failing(reason): called once if the worker takes itself out of
        service (the Ray actor leaves the registry then). decode_targets: where Prefill may push
        KV (the Ray actor gives the registry's live decode workers; None: anywhere)."""
        self.config = config
        # NOTE: the KV channels this worker dials use the same keepalive policy as its server
        self._dial = dial or (lambda target: GrpcKVChannel(target, self.security, config.connections))
        self._decode_targets = decode_targets
        self.security = config.security or SecurityConfig()
        loaded = loaded or load_model(config.engine.model_path, progress=False)
        self.engine = LLMEngine(loaded, config.engine, publisher)
        self.layout = KVLayout.of_cache(self.engine.kv_cache, self.engine.fingerprint)
        self.sender = LayerwiseSender(self.engine, self.layout, config.max_chunk_bytes)
        self.receiver = KVReceiver(self.engine, self.layout, config.parked_ttl_s)
        self._on_failing = on_failing
        self.metrics = WorkerMetrics()
        self.loop = EngineLoop(self.engine, observer=self.sender, max_failed_steps=config.max_failed_steps,
                               on_failing=self._out_of_service,
                               observe_step=self.metrics.step_seconds.observe)
        self.auditor = KVAuditor(self.engine)
        self.scrubber = scrubber_for(self.auditor, config.audit_interval_s, config.audit_max_fraction)
        self.faults = (FaultInjector(config.fault_plan, sleep=fault_sleep)
                       if config.fault_plan is not None else None)
        self.epoch = epoch
        self.address = ""
        self.metrics_endpoint = (MetricsEndpoint(self.metrics.registry, config.host, config.metrics_port)
                                 if config.metrics_port is not None else None)
        self.health = health.HealthServicer()
        self.call_limiter = CallLimiter(call_limits(config))
        self.kv_servicer = kv_transfer_servicer(self.receiver, config)
        self._server: grpc.Server | None = None
        self.servicer: WorkerServicer | None = None

    def start(self) -> str:
        server = self._grpc_server()
        for warning in self.security.exposure_warnings(self.config.host, public=False):
            log.warning("worker %s: %s", self.config.worker_id, warning)
        port = self.security.add_port(server, f"{self.config.host}:{self.config.port}")
        if port == 0:
            raise OSError(f"worker {self.config.worker_id}: cannot bind "
                          f"{self.config.host}:{self.config.port}")
        self.address = f"{self.config.advertise_host or self.config.host}:{port}"
        if self.metrics_endpoint is not None:
            self.metrics_endpoint.start()
        self.servicer = WorkerServicer(self.engine, self.loop, self.sender, self.receiver, self.identity(),
                                       self.metrics, transfer_timeout_s=self.config.transfer_timeout_s,
                                       faults=self.faults, security=self.security, dial=self._dial,
                                       decode_targets=self._decode_targets, auditor=self.auditor)
        self.metrics.read_status_from(self.servicer.status)
        worker_pb2_grpc.add_WorkerServicer_to_server(self.servicer, server)
        kv_transfer_pb2_grpc.add_KVTransferServicer_to_server(self.kv_servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        self.loop.start()
        self.scrubber.start()
        server.start()
        self._server = server
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        return self.address

    def _grpc_server(self) -> grpc.Server:
        """The server, with a thread for every call the limits admit; gRPC's own cap is the backstop.
        NOTE: the limiter comes after the cluster-secret gate, so a refused call is never counted."""
        threads = self.call_limiter.total_calls + SPARE_THREADS
        return grpc.server(futures.ThreadPoolExecutor(max_workers=threads), maximum_concurrent_rpcs=threads,
                           options=server_options(self.config.connections),
                           interceptors=[*self.security.server_interceptors(public=False), self.call_limiter])

    def identity(self) -> worker_pb2.WorkerStatus:
        c = self.config
        metrics = self.metrics_endpoint.address if self.metrics_endpoint is not None else ""
        return worker_pb2.WorkerStatus(worker_id=c.worker_id, role=c.role, address=self.address,
                                       node=c.node, epoch=self.epoch, metrics_address=metrics)

    def status(self) -> worker_pb2.WorkerStatus:
        assert self.servicer is not None, "start() the worker first"
        return self.servicer.status()

    def _out_of_service(self, failed_steps: int) -> None:
        reason = f"its engine failed {failed_steps} steps in a row (see its log); restart it"
        log.error("worker %s: %s", self.config.worker_id, reason)
        self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.servicer is not None:
            self.servicer.failing = reason
        if self._on_failing is not None:
            self._on_failing(reason)

    def drain(self, grace_s: float) -> bool:
        """Take no new requests (health NOT_SERVING; Prefill and fresh Decode calls are UNAVAILABLE)
        and wait up to grace_s for in-flight ones, including KV on its way here, to finish.
        True when everything finished in time. stop() afterwards."""
        self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.servicer is not None:
            self.servicer.serving = False
        deadline = time.monotonic() + grace_s
        while self.loop.num_streams() or self.engine.load().used_blocks:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def stop(self, grace_s: float = 0.0) -> None:
        self.health.enter_graceful_shutdown()
        if self.servicer is not None:
            self.servicer.serving = False
        if self._server is not None:
            self._server.stop(grace_s).wait()
        self.scrubber.stop()
        self.loop.stop()
        if self.servicer is not None:
            self.servicer.close()
        if self.metrics_endpoint is not None:
            self.metrics_endpoint.stop()


def call_limits(config: WorkerConfig) -> list[CallLimit]:
    """A worker's call limits: Health.Watch streams, and every Worker and KVTransfer call but the
    quick control calls."""
    worker = worker_pb2.DESCRIPTOR.services_by_name["Worker"]
    kv = kv_transfer_pb2.DESCRIPTOR.services_by_name["KVTransfer"]
    calls = CallLimit("Worker and KVTransfer calls", config.max_concurrent_calls,
                      "WorkerConfig.max_concurrent_calls", (service_prefix(worker), service_prefix(kv)),
                      exclude=method_paths(worker, "Status", "Abort"))
    return [health_watch_limit(config.max_health_watches, "WorkerConfig.max_health_watches"), calls]


def kv_transfer_servicer(receiver: KVReceiver, config: WorkerConfig) -> KVTransferServicer:
    """The KVTransfer service, with the config's per-peer cap and time limit on incoming pushes."""
    return KVTransferServicer(receiver, max_pushes_per_peer=config.max_pushes_per_peer,
                              time_limit_s=config.push_time_limit_s)
