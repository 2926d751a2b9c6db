"""WorkerServer: builds one worker (engine, loop, services) and runs its gRPC server.

The Worker, KVTransfer and health services share one port, so a worker has one address.
Ray actors (prefill_worker/, decode_worker/) and tests construct this directly.

Security (config.security, None = plaintext and no checks): Worker and KVTransfer demand
the cluster secret, health stays open, and the port serves TLS when the config has a
certificate. The same config dials decode workers for KV pushes (an internal client).
"""

from __future__ import annotations

import logging
import socket
import time
import uuid
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.engine.audit import KVAuditor
from pdserve.engine.config import EngineConfig
from pdserve.engine.events import KVEventPublisher
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.weights import LoadedModel, load_model
from pdserve.kvwire import KVLayout
from pdserve.metrics import MetricsEndpoint
from pdserve.security import SecurityConfig
from pdserve.transfer.faults import FaultInjector, FaultPlan
from pdserve.transfer.grpc_transport import GRPC_OPTIONS, KVTransferServicer
from pdserve.transfer.receiver import KVReceiver
from pdserve.transfer.sender import LayerwiseSender
from pdserve.worker.engine_loop import EngineLoop
from pdserve.worker.metrics import WorkerMetrics
from pdserve.worker.scrubber import DEFAULT_MAX_FRACTION, check_scrubber_settings, scrubber_for
from pdserve.worker.service import WorkerServicer
from protos.pdserve.v1 import kv_transfer_pb2_grpc, worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode")


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
    grpc_threads: int = 32
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
        if not self.worker_id:
            object.__setattr__(self, "worker_id", f"{self.role}-{uuid.uuid4().hex[:8]}")


class WorkerServer:
    def __init__(self, config: WorkerConfig, loaded: LoadedModel | None = None,
                 publisher: KVEventPublisher | None = None, epoch: int = 0) -> None:
        self.config = config
        self.security = config.security or SecurityConfig()
        loaded = loaded or load_model(config.engine.model_path, progress=False)
        self.engine = LLMEngine(loaded, config.engine, publisher)
        self.layout = KVLayout.of_cache(self.engine.kv_cache, self.engine.fingerprint)
        self.sender = LayerwiseSender(self.engine.kv_cache, self.layout, config.max_chunk_bytes)
        self.receiver = KVReceiver(self.engine, self.layout, config.parked_ttl_s)
        self.loop = EngineLoop(self.engine, layer_hook=self.sender)
        self.auditor = KVAuditor(self.engine)
        self.scrubber = scrubber_for(self.auditor, config.audit_interval_s, config.audit_max_fraction)
        self.faults = FaultInjector(config.fault_plan) if config.fault_plan is not None else None
        self.epoch = epoch
        self.address = ""
        self.metrics = WorkerMetrics()
        self.metrics_endpoint = (MetricsEndpoint(self.metrics.registry, config.host, config.metrics_port)
                                 if config.metrics_port is not None else None)
        self.health = health.HealthServicer()
        self._server: grpc.Server | None = None
        self.servicer: WorkerServicer | None = None

    def start(self) -> str:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=self.config.grpc_threads),
                             options=GRPC_OPTIONS,
                             interceptors=self.security.server_interceptors(public=False))
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
                                       faults=self.faults, security=self.security, auditor=self.auditor)
        self.metrics.read_status_from(self.servicer.status)
        worker_pb2_grpc.add_WorkerServicer_to_server(self.servicer, server)
        kv_transfer_pb2_grpc.add_KVTransferServicer_to_server(KVTransferServicer(self.receiver), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        self.loop.start()
        self.scrubber.start()
        server.start()
        self._server = server
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        return self.address

    def identity(self) -> worker_pb2.WorkerStatus:
        c = self.config
        metrics = self.metrics_endpoint.address if self.metrics_endpoint is not None else ""
        return worker_pb2.WorkerStatus(worker_id=c.worker_id, role=c.role, address=self.address,
                                       node=c.node, epoch=self.epoch, metrics_address=metrics)

    def status(self) -> worker_pb2.WorkerStatus:
        assert self.servicer is not None, "start() the worker first"
        return self.servicer.status()

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
