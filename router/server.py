"""RouterServer: the Generation service on a port, with gRPC health and reflection.

The public server takes requests of at most limits.max_message_bytes (gRPC answers a bigger
one RESOURCE_EXHAUSTED before it is parsed) and has a thread for every Generate stream the
limits allow, one for every open stream its CallLimiter admits, and SPARE_THREADS for Admin,
Health.Check and refusals; past that, gRPC refuses calls at once instead of queueing them.
Health and reflection need no token, and a reflection stream holds its thread while it is open
(grpc_health's Watch holds none, but keeps state per stream): past max_reflection_streams /
max_health_watches such streams are refused at once (RESOURCE_EXHAUSTED naming the limit), so
idle ones cannot starve Generate (pdserve/call_limits.py). Connections follow
config.connections (keepalive, ping policy, idle and age limits: pdserve/grpc_options.py).

Security (config.security, None = plaintext and no checks): Generation and Admin demand a
bearer API token, health and reflection stay open; the port serves TLS when the config has
a certificate; the router dials workers with the same TLS and the cluster secret
(router/workers.py). Binding a non-loopback host logs what the config leaves open.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from typing import Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.call_limits import CallLimiter, health_watch_limit, reflection_limit
from pdserve.engine.hashing import CACHE_ISOLATION
from pdserve.engine.sampling_defaults import SamplingDefaults
from pdserve.engine.tokenizer import Tokenizer
from pdserve.grpc_options import ConnectionPolicy, server_options
from pdserve.metrics import MetricsEndpoint
from pdserve.security import SecurityConfig
from protos.pdserve.v1 import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc
from router.admin import NOT_IN_RAY, AdminServicer, RayHome, RouterIdentity
from router.config import MigrationPolicy, PlacementConfig, RequestDeadlines
from router.http.server import HttpFrontDoor, ModelCard
from router.limits import RequestLimits
from router.metrics import RouterMetrics
from router.placement import MatchFn, Placer
from router.service import GenerationServicer
from router.workers import WorkerDirectory, WorkerRecord

log = logging.getLogger(__name__)

SPARE_THREADS = 16  # beyond the limited calls: Admin, Health.Check, and refusing extra calls


class Companion(Protocol):
    """Something that runs beside the router for its lifetime (the prefix index's mirror)."""

    def start(self) -> None: ...

    def stop(self) -> None: ...


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    limits: RequestLimits = field(default_factory=RequestLimits)
    deadlines: RequestDeadlines = field(default_factory=RequestDeadlines)
    migration: MigrationPolicy = field(default_factory=MigrationPolicy)  # streams whose decode worker breaks
    # none: any request may reuse any other's cached prefix; token: only requests of the same API token
    # (their blocks are hashed with a salt of the token's: pdserve/engine/hashing.py request_salt).
    cache_isolation: str = "none"
    refresh_s: float = 0.5
    grpc_threads: int = 64  # at least; raised to fit limits.max_concurrent_streams
    metrics_port: int | None = 0  # Prometheus /metrics on host:port; 0 = any free port, None = off
    security: SecurityConfig | None = None  # None: plaintext, no tokens, no cluster secret
    connections: ConnectionPolicy = field(default_factory=ConnectionPolicy)  # also the worker channels'
    # Open streams of the services that need no token; more are refused at once.
    max_reflection_streams: int = 8
    max_health_watches: int = 16
    # The OpenAI-compatible HTTP API (router/http/) on host:http_port; 0 = any free port, None = off.
    http_port: int | None = None
    served_model_name: str = "pdserve"  # the `model` HTTP requests name (the launcher uses the model's)
    architecture: str | None = None  # the served model's family, for /v1/models (the launcher reads it)
    # What a request's unset temperature/top_p/top_k become: the served model's (the launcher reads
    # them with the model, `pdserve up --default-*` on top); the neutral 1.0/1.0/0 when not given.
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)

    def __post_init__(self) -> None:
        if self.cache_isolation not in CACHE_ISOLATION:
            raise ValueError(f"cache_isolation must be one of {', '.join(CACHE_ISOLATION)}, "
                             f"got {self.cache_isolation!r}")
        for name in ("max_reflection_streams", "max_health_watches", "grpc_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"router config: {name} must be >= 1, got {getattr(self, name)}")


class RouterServer:
    def __init__(self, config: RouterConfig, tokenizer: Tokenizer,
                 live_workers: Callable[[], Sequence[WorkerRecord]], *, match: MatchFn | None = None,
                 load_of: Callable[[str], dict[str, int]] | None = None,
                 sweep: Callable[[], object] | None = None, rng: random.Random | None = None,
                 companions: Sequence[Companion] = (), ray_home: RayHome = NOT_IN_RAY) -> None:
        self.config = config
        self.ray_home = ray_home
        self.companions = list(companions)  # started before the port opens, stopped after it closes
        self.security = config.security or SecurityConfig()
        if config.cache_isolation == "token" and not self.security.api_tokens:
            raise ValueError("cache isolation 'token' needs API tokens (--api-token-file): without them "
                             "requests carry no tenant to keep apart")
        self.directory = WorkerDirectory(live_workers, config.refresh_s, load_of, self.security,
                                         connections=config.connections, sweep=sweep)
        self.placer = Placer(self.directory, config.placement, match, rng=rng)
        self.metrics = RouterMetrics()
        self.metrics_endpoint = (MetricsEndpoint(self.metrics.registry, config.host, config.metrics_port)
                                 if config.metrics_port is not None else None)
        self.servicer = GenerationServicer(tokenizer, self.directory, self.placer, config.deadlines,
                                           self.metrics, config.limits, config.cache_isolation,
                                           config.sampling_defaults, config.migration)
        self.admin = AdminServicer(self.directory, self.placer, lambda: self.servicer.requests_in_flight,
                                   self.identity, self.servicer.predictions.accuracy)
        self.health = health.HealthServicer()
        self.call_limiter = CallLimiter([
            reflection_limit(config.max_reflection_streams, "RouterConfig.max_reflection_streams"),
            health_watch_limit(config.max_health_watches, "RouterConfig.max_health_watches")])
        self.http = self._http_front_door(tokenizer) if config.http_port is not None else None
        self.address = ""
        self._server: grpc.Server | None = None

    def _http_front_door(self, tokenizer: Tokenizer) -> HttpFrontDoor:
        c = self.config
        card = ModelCard(c.served_model_name, c.limits.max_context_tokens,
                         {"sampling_defaults": c.sampling_defaults.as_dict()}, c.architecture)
        return HttpFrontDoor(self.servicer, tokenizer, card, self.metrics.registry,
                             lambda: len(self.directory.candidates("decode")), self.security,
                             host=c.host, port=c.http_port, max_body_bytes=c.limits.max_message_bytes,
                             max_streams=c.limits.max_concurrent_streams)

    @property
    def http_url(self) -> str:
        return self.http.url if self.http is not None else ""

    @property
    def sampling_defaults(self) -> SamplingDefaults:
        """The defaults in force, for whoever lists them (`pdserve up`'s banner, /v1/models)."""
        return self.servicer.sampling_defaults

    @property
    def metrics_address(self) -> str:
        return self.metrics_endpoint.address if self.metrics_endpoint is not None else ""

    def identity(self) -> RouterIdentity:
        return RouterIdentity(self.address, self.metrics_address, self.config.placement.routing,
                              self.ray_home)

    def start(self) -> str:
        threads = self.threads()
        # NOTE: the servicer refuses streams over the limit with a retry hint, the call limiter the
        # open services' streams; gRPC's own cap is the backstop, so that a flood of calls cannot
        # queue behind busy threads. The limiter comes after the token gate: a refused call is
        # never counted.
        interceptors = [*self.security.server_interceptors(public=True), self.call_limiter]
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads), options=self._server_options(),
                             maximum_concurrent_rpcs=threads, interceptors=interceptors)
        generation_pb2_grpc.add_GenerationServicer_to_server(self.servicer, server)
        admin_pb2_grpc.add_AdminServicer_to_server(self.admin, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        names = (generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name,
                 admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name,
                 health.SERVICE_NAME, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, server)
        for warning in self.security.exposure_warnings(self.config.host, public=True):
            log.warning("router: %s", warning)
        port = self.security.add_port(server, f"{self.config.host}:{self.config.port}")
        if port == 0:
            raise OSError(f"router: cannot bind {self.config.host}:{self.config.port}; "
                          "is another pdserve running? choose another --port")
        for companion in self.companions:
            companion.start()
        self.directory.start()
        if self.metrics_endpoint is not None:
            self.metrics_endpoint.start()
        server.start()
        self._server = server
        self.address = f"{self.config.host}:{port}"
        if self.http is not None:
            self.http.start()
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        return self.address

    def threads(self) -> int:
        """The server's threads: every Generate stream and limited call at once, plus spare ones."""
        needed = self.config.limits.max_concurrent_streams + self.call_limiter.total_calls + SPARE_THREADS
        return max(self.config.grpc_threads, needed)

    def _server_options(self) -> list[tuple[str, int]]:
        return server_options(self.config.connections, self.config.limits.max_message_bytes)

    def stop(self, grace_s: float = 0.0) -> None:
        self.health.enter_graceful_shutdown()
        if self.http is not None:
            self.http.stop()
        if self._server is not None:
            self._server.stop(grace_s).wait()
        self.directory.stop()
        for companion in reversed(self.companions):
            companion.stop()
        self.admin.close()
        if self.metrics_endpoint is not None:
            self.metrics_endpoint.stop()
