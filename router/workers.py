"""The router's view of the workers: who is live (from the registry), how busy, and stubs.

The live list is refreshed in the background from a `source` (the Redis registry in a
cluster). Load is shared between router replicas: each refresh also reads every worker's own
heartbeat report (`load_source`), and a worker's load is that report plus this router's change in
requests in flight on it since it read the report (router/shared_load.py); with no report it is
this router's own count. Stubs dial with the router's
SecurityConfig as an internal client: its TLS, and the cluster secret on every call; and with
the router's ConnectionPolicy (keepalive while calls are open: pdserve/grpc_options.py).

Each refresh, in the background thread:

    registry read fails              keep the last view (Redis down, hung, refusing)
    a worker left the registry       ask it (gRPC health, short deadline): SERVING -> keep it,
                                     anything else -> drop it
    every SWEEP_EVERY refreshes      sweep(): delete what departed workers left in Redis,
                                     through the circuit breaker the placer reads the index by

NOTE: a worker's lease can lapse while the worker is fine, because Redis refuses or loses
its heartbeats (read-only, ACL revoked, stopped past the lease, restarted empty). Dropping it
would turn a Redis fault into an outage, so the worker itself decides: one that drains,
crashes or leaves on purpose stops answering SERVING first (WorkerActor.drain) and goes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.grpc_options import ConnectionPolicy, channel_options
from pdserve.index.breaker import CircuitBreaker, CircuitOpen
from pdserve.security import SecurityConfig
from protos.pdserve.v1 import worker_pb2_grpc
from router.scoring import Candidate
from router.shared_load import LoadReport, SeenReport, estimated_load, note_report

log = logging.getLogger(__name__)

# A channel to an address no live worker has had for this long, with no request of ours on it, is
# closed: a restarted worker comes back on a new port, and each old channel would otherwise stay.
CHANNEL_RETIRE_S = 30.0
SWEEP_EVERY = 20  # refreshes: every 10 s at the default refresh_s of 0.5 s
HEALTH_TIMEOUT_S = 0.5  # asking a worker that left the registry whether it still serves


@dataclass(frozen=True)
class LoadView:
    """A worker's load as this router sees it, for the Admin service."""

    reported: int | None  # running + waiting in the worker's last report (None: no report)
    seq: int  # that report's number (0: none)
    estimate: int  # what placement scores it with


class WorkerRecord(Protocol):
    """What the directory reads of a registry entry (pdserve/index/registry.py WorkerInfo)."""

    worker_id: str
    role: str
    address: str
    epoch: int
    block_size: int
    num_blocks: int
    salt: str  # hex of the worker's engine salt


@dataclass(frozen=True)
class BlockHashing:
    """How a worker hashes its blocks: workers with equal ones share block hashes (and KV layouts)."""

    block_size: int
    salt: bytes


class WorkerDirectory:
    def __init__(self, source: Callable[[], Sequence[WorkerRecord]], refresh_s: float = 0.5,
                 load_source: Callable[[str], dict[str, int]] | None = None,
                 security: SecurityConfig | None = None, clock: Callable[[], float] = time.monotonic, *,
                 connections: ConnectionPolicy | None = None, sweep: Callable[[], object] | None = None,
                 breaker: CircuitBreaker | None = None) -> None:
        self._source = source
        self._channel_options = channel_options(connections)
        self._sweep = sweep
        self.breaker = breaker or CircuitBreaker()  # the index store's health, as this router sees it
        self._refreshes = 0
        self._kept: set[str] = set()  # ids kept after leaving the registry (logged once each)
        self._registry_failing = False
        self._clock = clock
        self._security = security or SecurityConfig()
        self._load_source = load_source
        self._loads: dict[str, SeenReport] = {}
        self._refresh_s = refresh_s
        self._workers: dict[str, WorkerRecord] = {}
        self._hashing: Mapping[str, BlockHashing] = {}  # from _workers, built once per refresh
        self._in_flight: Counter[str] = Counter()
        self._channels: dict[str, grpc.Channel] = {}
        self._absent_since: dict[str, float] = {}  # channel address -> when no live worker had it
        self._requests_on: Counter[str] = Counter()  # channel address -> our requests in flight there
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._refresh_loop, name="worker-directory", daemon=True)

    def start(self) -> None:
        self.refresh()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()

    def refresh(self) -> None:
        try:
            registered = {w.worker_id: w for w in self._source()}
        except Exception as e:  # the registry is down: keep the last known view
            if not self._registry_failing:
                log.warning("worker registry unavailable, keeping the %d known workers until it answers: %s",
                            len(self._workers), e)
            self._registry_failing = True
            return
        if self._registry_failing:
            log.info("worker registry answers again: %d workers registered", len(registered))
            self._registry_failing = False
        loads = self._read_loads(registered)
        with self._lock:
            left = [w for worker_id, w in self._workers.items() if worker_id not in registered]
        workers = {**self._still_serving(left), **registered}
        hashing = MappingProxyType({w.worker_id: BlockHashing(w.block_size, bytes.fromhex(w.salt))
                                    for w in workers.values()})
        with self._lock:
            self._workers, self._hashing = workers, hashing
            self._loads = {w: seen for w in workers
                           if (seen := note_report(self._loads.get(w), loads.get(w), self._in_flight[w]))}
            retired = self._retire_channels({w.address for w in workers.values()})
        for channel in retired:
            channel.close()

    def _retire_channels(self, live_addresses: set[str]) -> list[grpc.Channel]:
        """Channels whose address has been without a live worker for CHANNEL_RETIRE_S and carries
        none of our requests, taken out of the cache (the caller closes them). Holds the lock."""
        now, retired = self._clock(), []
        for address in list(self._channels):
            if address in live_addresses:
                self._absent_since.pop(address, None)
                continue
            since = self._absent_since.setdefault(address, now)
            if now - since >= CHANNEL_RETIRE_S and not self._requests_on[address]:
                retired.append(self._channels.pop(address))
                del self._absent_since[address]
        return retired

    def _read_loads(self, workers: dict[str, WorkerRecord]) -> dict[str, LoadReport | None]:
        if self._load_source is None:
            return {}
        try:
            return {w: LoadReport.of(self._load_source(w)) for w in workers}
        except Exception:  # load is a hint: keep routing on this router's own counts
            return {}

    def _still_serving(self, left: list[WorkerRecord]) -> dict[str, WorkerRecord]:
        """The workers that left the registry but answer health SERVING (see the module's NOTE)."""
        kept = {}
        for w in left:
            try:
                reply = health_pb2_grpc.HealthStub(self._channel(w.address)).Check(
                    health_pb2.HealthCheckRequest(), timeout=HEALTH_TIMEOUT_S)
                serving = reply.status == health_pb2.HealthCheckResponse.SERVING
            except grpc.RpcError:
                serving = False
            if serving:
                kept[w.worker_id] = w
                if w.worker_id not in self._kept:
                    log.warning("worker %s left the registry but still serves; keeping it (is Redis refusing "
                                "its heartbeats?)", w.worker_id)
        self._kept = set(kept)
        return kept

    def sweep(self) -> None:
        """Delete what departed workers left in Redis, unless the breaker says Redis is failing.

        NOTE: not while a worker is kept after leaving the registry: Redis lost or refused its
        heartbeats, and its entries would be deleted only for it to republish them a beat later.
        """
        if self._sweep is None or self._kept:
            return
        try:
            self.breaker.run(self._sweep)
        except CircuitOpen:
            pass
        except Exception as e:  # retried SWEEP_EVERY refreshes later
            log.warning("sweeping the prefix index failed: %s", e)

    def _refresh_loop(self) -> None:
        while not self._stop.wait(self._refresh_s):
            try:
                self.refresh()
                self._refreshes += 1
                if self._refreshes % SWEEP_EVERY == 0:
                    self.sweep()
            except Exception:  # NOTE: a dead refresh thread freezes the router's view for good
                log.exception("refreshing the worker directory failed; retrying")

    # --- queries ------------------------------------------------------------------------
    def workers(self, role: str | None = None) -> list[WorkerRecord]:
        with self._lock:
            return [w for w in self._workers.values() if role is None or w.role == role]

    def candidates(self, role: str) -> list[Candidate]:
        out = []
        with self._lock:  # NOTE: once per placement: one lock, no method call per worker
            for w in self._workers.values():
                if w.role == role:
                    seen = self._loads.get(w.worker_id)
                    load = estimated_load(seen, self._in_flight[w.worker_id])
                    out.append(Candidate(w.worker_id, w.address, load, self._used_fraction(w, seen)))
        return out

    def block_hashing(self) -> Mapping[str, BlockHashing]:
        """worker id -> how it hashes its blocks, as its registry entry says (read-only; a refresh
        replaces it, so a placement's view stays whole)."""
        with self._lock:
            return self._hashing

    def tiered(self) -> set[str]:
        """The workers whose registry entry lists a tier below the device pool (host, disk)."""
        with self._lock:
            return {w.worker_id for w in self._workers.values() if w.lower_tier_blocks}

    def capacity_tokens(self, worker_id: str) -> int:
        """KV tokens the worker's pool holds (0 when unknown)."""
        with self._lock:
            w = self._workers.get(worker_id)
        return getattr(w, "num_blocks", 0) * getattr(w, "block_size", 0) if w else 0

    def used_block_fraction(self, worker_id: str) -> float:
        """Heartbeat-reported share of the worker's KV blocks in use (0 when unknown)."""
        with self._lock:
            w, seen = self._workers.get(worker_id), self._loads.get(worker_id)
        return self._used_fraction(w, seen) if w else 0.0

    @staticmethod
    def _used_fraction(w: WorkerRecord, seen: SeenReport | None) -> float:
        total = getattr(w, "num_blocks", 0)
        return seen.report.used_blocks / total if total and seen else 0.0

    def in_flight(self, worker_id: str) -> int:
        with self._lock:
            return self._in_flight[worker_id]

    def load_view(self, worker_id: str) -> LoadView:
        with self._lock:
            seen, in_flight = self._loads.get(worker_id), self._in_flight[worker_id]
        if seen is None:
            return LoadView(None, 0, in_flight)
        return LoadView(seen.report.queued, seen.report.seq, estimated_load(seen, in_flight))

    def stub(self, address: str) -> worker_pb2_grpc.WorkerStub:
        """The Worker service every worker serves (Abort, Status, Audit)."""
        return worker_pb2_grpc.WorkerStub(self._channel(address))

    def prefill_stub(self, address: str) -> worker_pb2_grpc.PrefillServiceStub:
        return worker_pb2_grpc.PrefillServiceStub(self._channel(address))

    def decode_stub(self, address: str) -> worker_pb2_grpc.DecodeServiceStub:
        return worker_pb2_grpc.DecodeServiceStub(self._channel(address))

    def _channel(self, address: str) -> grpc.Channel:
        with self._lock:
            channel = self._channels.get(address)
            if channel is None:
                channel = self._security.open_channel(address, self._channel_options, internal=True)
                self._channels[address] = channel
        return channel

    @contextmanager
    def track(self, *candidates: Candidate | None) -> Iterator[None]:
        """Count a request as in flight on these workers for the duration of the block."""
        ids = [c.worker_id for c in candidates if c is not None]
        addresses = [c.address for c in candidates if c is not None]
        with self._lock:
            self._in_flight.update(ids)
            self._requests_on.update(addresses)
        try:
            yield
        finally:
            with self._lock:
                self._in_flight.subtract(ids)
                self._requests_on.subtract(addresses)
                for address in addresses:
                    if self._requests_on[address] <= 0:
                        self._requests_on.pop(address, None)
