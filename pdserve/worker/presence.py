"""A worker's presence in Redis: registration and lease renewal with load.

    start: register(info) under a fresh epoch (taken by the caller from next_epoch)
    every heartbeat_s: heartbeat(info, load) -> Lease, the load numbered (epoch, seq) so that
                   every router can tell a new report from one it read (router/shared_load.py)
        STARTED    the store lost our lease (Redis restarted, or refused writes, or we were
                   partitioned past the TTL): ask the publisher to resync the index
        RENEWED    nothing to do
        SUPERSEDED a newer incarnation of this worker exists: stop beating and publishing
    stop: deregister (graceful shutdown only; a crashed worker just expires)

Redis misbehaving never stops the worker: every call goes through the worker's circuit
breaker (shared with its index publisher), every failure is logged and retried on a later
beat, and the heartbeat thread catches everything, so it cannot die and leave a healthy
worker out of routing for good.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable

from pdserve.index.base import Lease, StoreUnavailable
from pdserve.index.breaker import CircuitBreaker, CircuitOpen
from pdserve.index.publisher import IndexPublisher
from pdserve.index.registry import WorkerInfo, WorkerRegistry

log = logging.getLogger(__name__)


class Presence:
    def __init__(self, registry: WorkerRegistry, publisher: IndexPublisher, info: WorkerInfo,
                 load: Callable[[], dict[str, int]], heartbeat_s: float = 1.0, ttl_s: float = 5.0,
                 breaker: CircuitBreaker | None = None) -> None:
        self.registry, self.publisher, self.info = registry, publisher, info
        self._load = load
        self.heartbeat_s, self.ttl_s = heartbeat_s, ttl_s
        self.breaker = breaker or publisher.breaker
        self.superseded = False
        self._reports = itertools.count(1)
        self._failing = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="presence", daemon=True)

    def start(self) -> None:
        try:
            self.registry.register(self.info, self.ttl_s)
        except StoreUnavailable as e:  # the heartbeat registers once Redis answers again
            log.warning("could not register %s yet: %s", self.info.worker_id, e)
        self._thread.start()

    def stop(self, deregister: bool = True) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if deregister:
            try:
                self.registry.deregister(self.info.worker_id)
            except StoreUnavailable as e:
                log.warning("could not deregister %s (its lease will expire): %s", self.info.worker_id, e)

    def beat(self) -> Lease | None:
        """One heartbeat; None when Redis did not take it (it is retried on the next beat)."""
        try:
            report = self.load_report()
            lease = self.breaker.run(lambda: self.registry.heartbeat(self.info, self.ttl_s, report))
        except StoreUnavailable as e:
            if not self._failing and not isinstance(e, CircuitOpen):
                log.warning("heartbeat of %s failed; retrying every %.1f s: %s", self.info.worker_id,
                            self.heartbeat_s, e)
                self._failing = True
            return None
        if self._failing:
            log.info("heartbeat of %s taken again (%s)", self.info.worker_id, lease.value)
            self._failing = False
        if lease is Lease.SUPERSEDED:
            self.superseded = True
            self.publisher.stop()
            log.error("worker %s epoch %d was superseded by a newer incarnation",
                      self.info.worker_id, self.info.epoch)
        elif lease is Lease.STARTED:
            self.publisher.resync()
        return lease

    def load_report(self) -> dict[str, int]:
        """The worker's load figures, numbered: a new seq each beat."""
        return {**self._load(), "epoch": self.info.epoch, "seq": next(self._reports)}

    def _run(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            if self.superseded:
                continue
            try:
                self.beat()
            except Exception:  # NOTE: a dead heartbeat thread takes a healthy worker out of routing
                log.exception("heartbeat of %s failed unexpectedly; beating on", self.info.worker_id)
