"""The background KV scrubber: audits a few cached blocks at a time, within a share of wall time.

    start -> wait interval_s -> audit one random target and its cached ancestors (one recompute)
          -> busy = that audit's measured duration
          -> wait max(interval_s, busy x (1 - f) / f) -> audit -> ... -> stop (joins the thread)

Every audit is followed by a wait of at least busy x (1 - f) / f, so over the scrubber's life
busy / (busy + waiting) <= f, where f is max_fraction: the share is measured from each audit's
own duration (the recompute, the copies, waiting for the engine's lock), never assumed from its
size. The audit holds the engine's lock only to plan, copy the blocks and evict; the recompute
runs beside the engine loop, on the same cores, which is the time f bounds.

Off by default (WorkerConfig.audit_interval_s None): the worker then has a NullScrubber.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # NOTE: only for the type: deploy/config.py reads the settings' check without torch
    from pdserve.engine.audit import KVAuditor

log = logging.getLogger(__name__)

DEFAULT_MAX_FRACTION = 0.05


class AuditScrubber:
    def __init__(self, auditor: KVAuditor, interval_s: float, max_fraction: float = DEFAULT_MAX_FRACTION,
                 targets_per_round: int = 1) -> None:
        check_scrubber_settings(interval_s, max_fraction)
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


def check_scrubber_settings(interval_s: float | None, max_fraction: float) -> None:
    if interval_s is not None and not interval_s > 0:
        raise ValueError(f"audit_interval_s must be > 0 seconds (None: no background audit), "
                         f"got {interval_s}")
    if not 0 < max_fraction <= 1:
        raise ValueError(f"audit_max_fraction must be in (0, 1], got {max_fraction}")


def scrubber_for(auditor: KVAuditor, interval_s: float | None,
                 max_fraction: float = DEFAULT_MAX_FRACTION) -> AuditScrubber | NullScrubber:
    if interval_s is None:
        return NullScrubber()
    return AuditScrubber(auditor, interval_s, max_fraction)
