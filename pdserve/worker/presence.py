"""A worker's presence in Redis: registration, lease renewal with load, index resync.

    start: register(info) under a fresh epoch (taken by the caller from next_epoch)
    every heartbeat_s: heartbeat(info, load) -> Lease
        STARTED    the store lost our lease (Redis restarted or we were partitioned past
                   the TTL): resync the index with every hash the pool holds now
        RENEWED    nothing to do, unless events were dropped while Redis was down: resync
        SUPERSEDED a newer incarnation of this worker exists: stop publishing
    stop: deregister (graceful shutdown only; a crashed worker just expires)

Redis being down never stops the worker: failures are logged and retried next beat.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from pdserve.index.base import Lease, StoreUnavailable
from pdserve.index.publisher import IndexPublisher
from pdserve.index.registry import WorkerInfo, WorkerRegistry

log = logging.getLogger(__name__)


class Presence:
    def __init__(self, registry: WorkerRegistry, publisher: IndexPublisher, info: WorkerInfo,
                 load: Callable[[], dict[str, int]], cached_hashes: Callable[[], list[bytes]],
                 heartbeat_s: float = 1.0, ttl_s: float = 5.0) -> None:
        self.registry, self.publisher, self.info = registry, publisher, info
        self._load, self._cached_hashes = load, cached_hashes
        self.heartbeat_s, self.ttl_s = heartbeat_s, ttl_s
        self.superseded = False
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
        self._thread.join(timeout=5)
        if deregister:
            try:
                self.registry.deregister(self.info.worker_id)
            except StoreUnavailable as e:
                log.warning("could not deregister %s (its lease will expire): %s", self.info.worker_id, e)

    def beat(self) -> Lease | None:
        try:
            lease = self.registry.heartbeat(self.info, self.ttl_s, self._load())
        except StoreUnavailable as e:
            log.debug("heartbeat of %s failed: %s", self.info.worker_id, e)
            return None
        if lease is Lease.SUPERSEDED:
            self.superseded = True
            log.error("worker %s epoch %d was superseded by a newer incarnation",
                      self.info.worker_id, self.info.epoch)
        elif lease is Lease.STARTED or not self.publisher.in_sync:
            self.publisher.resync(self._cached_hashes())
        return lease

    def _run(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            if not self.superseded:
                self.beat()
