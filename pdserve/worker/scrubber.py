"""The background KV scrubber: audits a few cached blocks at a time, within a share of wall time.

    start -> wait interval_s -> audit one random target and its cached ancestors (one recompute)
          -> busy = that audit's measured duration
          -> wait max(interval_s, busy x (1 - f) / f) -> audit -> ... -> stop (joins the thread)

Every audit is followed by a wait of at least busy x (1 - f) / f, so over the scrubber's life
busy / (busy + waiting) <= f, where f is max_fraction: the share is measured from each audit's
own duration (the recompute, the copies, waiting for the engine's lock), never assumed from its
size. The audit holds the engine's lock only to plan, copy the blocks and evict; the recompute
runs beside the engine loop, on the same cores, which is the time f bounds.

Off by default (AuditSchedule.interval_s None): the worker then has a NullScrubber. AuditSchedule is
the one declaration of these settings; ClusterSpec and WorkerSpec carry it as it is.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.field_error import FieldError
from pdserve.settings import setting

if TYPE_CHECKING:  # NOTE: only for the type: deploy/config.py reads the settings' check without torch
    from pdserve.engine.audit import KVAuditor

log = logging.getLogger(__name__)

DEFAULT_MAX_FRACTION = 0.05


@dataclass(frozen=True)
class AuditSchedule:
    """The background KV audit: every interval_s seconds (None = off), within max_fraction of wall time."""

    interval_s: float | None = setting(
        None, flag="--audit-interval-s", key="audit.interval_s", metavar="SECONDS",
        help="audit one random cached block and its cached ancestors every SECONDS at least, on every "
             "worker (default: off; `pdserve audit` runs one on demand)")
    max_fraction: float = setting(
        DEFAULT_MAX_FRACTION, flag="--audit-max-fraction", key="audit.max_fraction", metavar="F",
        help="most of each worker's wall time the scrubber may spend, measured: after an audit that took "
             "t seconds it waits at least t x (1 - F) / F")

    def __post_init__(self) -> None:
        if self.interval_s is not None and not self.interval_s > 0:
            raise FieldError("interval_s", "must be > 0 seconds (None: no background audit)", self.interval_s)
        if not 0 < self.max_fraction <= 1:
            raise FieldError("max_fraction", "must be in (0, 1]", self.max_fraction)


class AuditScrubber:
    def __init__(self, auditor: KVAuditor, interval_s: float, max_fraction: float = DEFAULT_MAX_FRACTION,
                 targets_per_round: int = 1) -> None:
        AuditSchedule(interval_s, max_fraction)  # checks them
        self.auditor = auditor
        self.interval_s, self.max_fraction = interval_s, max_fraction
        self.targets_per_round = targets_per_round
        self.rounds = 0
        self.busy_s = 0.0  # measured: the sum of every round's audit duration
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-scrubber", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def _run(self) -> None:
        wait = self.interval_s
        while not self._stop.wait(wait):
            started = time.perf_counter()
            try:
                report = self.auditor.audit(sample=self.targets_per_round)
            except Exception:  # NOTE: the scrubber must not die with one bad round; the next one retries
                log.exception("KV scrubber: audit round failed")
            else:
                if report.mismatched:
                    log.warning("KV scrubber: %d of %d blocks differed from their recompute; %d evicted",
                                report.mismatched, report.checked, report.evicted)
            busy = time.perf_counter() - started
            self.rounds += 1
            self.busy_s += busy
            wait = max(self.interval_s, busy * (1 - self.max_fraction) / self.max_fraction)


class NullScrubber:
    """No background audit (the default): nothing to start or stop."""

    def start(self) -> None:
        return None

    def stop(self) -> None:
        return None


def scrubber_for(auditor: KVAuditor, schedule: AuditSchedule) -> AuditScrubber | NullScrubber:
    if schedule.interval_s is None:
        return NullScrubber()
    return AuditScrubber(auditor, schedule.interval_s, schedule.max_fraction)
