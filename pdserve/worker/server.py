"""WorkerServer: one worker (engine, engine loop, gRPC server) and what both roles share.

    WorkerServer(config, role)
      LLMEngine, and the role attached to it (it may observe every step: the prefill role's sender)
      EngineLoop (thread)     steps the engine, fans outputs out to RequestStreams
      gRPC server, one port:  Worker (Abort, Status, Audit) + health, and the role's own services:
                              prefill_worker/ serves PrefillService; decode_worker/ serves
                              DecodeService and KVTransfer
      KVAuditor (+ an optional background scrubber, scrubber.py)

Nothing here names a role's servicer: a role (prefill_worker/role.py, decode_worker/role.py) is
handed to the server and adds its services itself. The Ray actors (pdserve/worker/actor.py and
the role packages' actor.py) and tests construct it.

Security (config.security, None = plaintext and no checks): every service but health demands the
cluster secret, and the port serves TLS when the config has a certificate.

Limits (refused at once with RESOURCE_EXHAUSTED naming the limit, never queued; see
pdserve/call_limits.py): at most max_concurrent_calls of the role's calls and Audit at once
(Status and Abort excepted: they are quick, and Abort frees blocks), set above the router's
per-decode admission limit (router.config.PlacementConfig.max_in_flight_per_decode) so that
it only ever stops a flood; at most max_health_watches Health.Watch streams. The thread pool has
a thread for every call the limits admit plus SPARE_THREADS. Connections follow
config.connections (keepalive, ping policy, idle and age limits: pdserve/grpc_options.py).
"""

from __future__ import annotations

import logging
import socket
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from typing import Protocol

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.call_limits import CallLimit, CallLimiter, health_watch_limit, method_paths, service_prefix
from pdserve.engine.audit import KVAuditor
from pdserve.engine.config import EngineConfig
from pdserve.engine.events import KVEventPublisher
from pdserve.engine.llm_engine import LLMEngine, StepObserver
from pdserve.engine.weights import LoadedModel
from pdserve.grpc_options import ConnectionPolicy, server_options
from pdserve.kvwire import KVLayout
from pdserve.metrics import MetricsEndpoint
from pdserve.roles import ROLES
from pdserve.security import SecurityConfig
from pdserve.worker.engine_loop import EngineLoop
from pdserve.worker.metrics import WorkerMetrics
from pdserve.worker.scrubber import AuditSchedule, scrubber_for
from pdserve.worker.service import ServingState, TokenTotals, WorkerParts, WorkerServicer
from protos.pdserve.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

SPARE_THREADS = 16  # beyond the limited calls: Status, Abort, Health.Check, and refusing extra calls
WORKER_CALLS = "the worker's calls"  # the limit on the role's calls and Audit (call_limits below)


@dataclass(frozen=True)
class WorkerConfig:
    """What every worker has, whatever its role (each role's own settings: PrefillConfig in
    prefill_worker/role.py, DecodeConfig in decode_worker/role.py)."""

    role: str
    engine: EngineConfig = field(default_factory=EngineConfig)
    worker_id: str = ""  # "" -> role + random suffix
    host: str = "127.0.0.1"  # the address to bind
    port: int = 0
    advertise_host: str | None = None  # what others dial (registry, transfers); None: host
    node: str = field(default_factory=socket.gethostname)
    # Engine steps that may fail in a row before the worker takes itself out of service (health
    # NOT_SERVING, every call UNAVAILABLE, and out of the registry on a Ray worker).
    max_failed_steps: int = 3
    # The role's calls and Audit at once (Status, Abort excepted); above the router's per-decode
    # admission limit (64 by default), so a router alone never meets it.
    max_concurrent_calls: int = 256
    max_health_watches: int = 16
    # The server's keepalive, ping policy, idle and age limits; the KV channels it dials use its keepalive.
    connections: ConnectionPolicy = field(default_factory=ConnectionPolicy)
    metrics_port: int | None = 0  # Prometheus /metrics on host:port; 0 = any free port, None = off
    security: SecurityConfig | None = None  # None: plaintext, no cluster secret
    audit: AuditSchedule = field(default_factory=AuditSchedule)  # the background KV audit (scrubber.py)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.max_failed_steps < 1:
            raise ValueError(f"max_failed_steps must be >= 1, got {self.max_failed_steps}")
        for name in ("max_concurrent_calls", "max_health_watches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.worker_id:
            object.__setattr__(self, "worker_id", f"{self.role}-{uuid.uuid4().hex[:8]}")


class Role(Protocol):
    """What one role brings to the shared worker.

    attach(engine, layout) as the worker is built (its observer, if any, then sees every engine
    step) -> serve(server, parts) adds its gRPC services -> fill_status(status) on every Status
    -> close() when the worker stops.
    """

    name: str  # one of ROLES
    observer: StepObserver | None
    limited_services: Sequence[ServiceDescriptor]  # every call of these counts to max_concurrent_calls

    def attach(self, engine: LLMEngine, layout: KVLayout) -> None: ...
    def serve(self, server: grpc.Server, parts: WorkerParts) -> None: ...
    def fill_status(self, status: worker_pb2.WorkerStatus) -> None: ...
    def close(self) -> None: ...


class WorkerServer:
    def __init__(self, config: WorkerConfig, role: Role, loaded: LoadedModel | None = None,
                 publisher: KVEventPublisher | None = None, epoch: int = 0, *,
                 on_failing: Callable[[str], None] | None = None) -> None:
        """on_failing(reason): called once if the worker takes itself out of service (the Ray
        actor leaves the registry then)."""
        if role.name != config.role:
            raise ValueError(f"a {role.name} role cannot serve a worker configured as {config.role!r}")
        self.config, self.role = config, role
        self.security = config.security or SecurityConfig()
        self.engine = (LLMEngine(loaded, config.engine, publisher) if loaded is not None
                       else LLMEngine.from_config(config.engine, progress=False, publisher=publisher))
        log.info("worker %s: kernels %s", config.worker_id, self.engine.kernels.describe())
        self.layout = KVLayout.of_cache(self.engine.kv_cache, self.engine.fingerprint,
                                        self.engine.model_config.architecture)
        role.attach(self.engine, self.layout)
        self._on_failing = on_failing
        self.metrics = WorkerMetrics()
        self.loop = EngineLoop(self.engine, observer=role.observer, max_failed_steps=config.max_failed_steps,
                               on_failing=self._out_of_service,
                               observe_step=self.metrics.step_seconds.observe)
        self.auditor = KVAuditor(self.engine)
        self.scrubber = scrubber_for(self.auditor, config.audit)
        self.state = ServingState(config.worker_id)
        self.epoch = epoch
        self.address = ""
        self.metrics_endpoint = (MetricsEndpoint(self.metrics.registry, config.host, config.metrics_port)
                                 if config.metrics_port is not None else None)
        self.health = health.HealthServicer()
        self.call_limiter = CallLimiter(call_limits(config, role.limited_services))
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
        parts = WorkerParts(self.engine, self.loop, self.metrics, self.state, TokenTotals(), self.security,
                            self.config.connections)
        self.servicer = WorkerServicer(parts, self.identity(), self.auditor, self.role.fill_status)
        self.metrics.read_status_from(self.servicer.status)
        worker_pb2_grpc.add_WorkerServicer_to_server(self.servicer, server)
        self.role.serve(server, parts)
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
                                       node=c.node, epoch=self.epoch, metrics_address=metrics,
                                       architecture=self.engine.model_config.architecture)

    def status(self) -> worker_pb2.WorkerStatus:
        assert self.servicer is not None, "start() the worker first"
        return self.servicer.status()

    def _out_of_service(self, failed_steps: int) -> None:
        reason = f"its engine failed {failed_steps} steps in a row (see its log); restart it"
        log.error("worker %s: %s", self.config.worker_id, reason)
        self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        self.state.failing = reason
        if self._on_failing is not None:
            self._on_failing(reason)

    def drain(self, grace_s: float) -> bool:
        """Take no new requests (health NOT_SERVING; Prefill and fresh Decode calls are UNAVAILABLE)
        and wait up to grace_s for in-flight ones, including KV on its way here, to finish: every
        request out of the engine and every call of the role's services over (a Decode stream has
        sent its last reply: the engine finishes a request before its replies have all gone out, and
        stop() cuts what is still to send). True when everything finished in time. stop() afterwards."""
        self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        self.state.serving = False
        deadline = time.monotonic() + grace_s
        while self.loop.num_streams() or self.engine.load().used_blocks or self._calls_in_flight():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def _calls_in_flight(self) -> int:
        return self.call_limiter.counts()[WORKER_CALLS].in_flight

    def stop(self, grace_s: float = 0.0) -> None:
        self.health.enter_graceful_shutdown()
        self.state.serving = False
        if self._server is not None:
            self._server.stop(grace_s).wait()
        self.scrubber.stop()
        self.loop.stop()
        self.role.close()
        if self.metrics_endpoint is not None:
            self.metrics_endpoint.stop()


def call_limits(config: WorkerConfig, role_services: Sequence[ServiceDescriptor]) -> list[CallLimit]:
    """A worker's call limits: Health.Watch streams, and every call of the role's services and of
    the Worker service but the quick control calls."""
    worker = worker_pb2.DESCRIPTOR.services_by_name["Worker"]
    prefixes = (service_prefix(worker), *(service_prefix(s) for s in role_services))
    calls = CallLimit(WORKER_CALLS, config.max_concurrent_calls, "WorkerConfig.max_concurrent_calls",
                      prefixes, exclude=method_paths(worker, "Status", "Abort"))
    return [health_watch_limit(config.max_health_watches, "WorkerConfig.max_health_watches"), calls]
