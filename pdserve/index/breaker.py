"""A circuit breaker for calls to the index store: Redis down must cost callers almost nothing.

    CLOSED     calls go through; a failure (error or timeout) opens the circuit
    OPEN       calls are skipped at once (the caller degrades: routes by load, keeps events
               queued) for open_s seconds
    HALF_OPEN  one call is let through: success closes the circuit, failure re-opens it

The router reads the prefix index through one (router/placement.py); each worker writes its
lease and index entries through its own (pdserve/worker/actor.py). Pure: the clock is a
parameter.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from pdserve.index.base import StoreUnavailable

T = TypeVar("T")


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitOpen(StoreUnavailable):
    """The call was not made: the circuit is open after a recent failure."""


class CircuitBreaker:
    def __init__(self, open_s: float = 2.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.open_s = open_s
        self.clock = clock
        self.state = BreakerState.CLOSED
        self.failures = 0
        self._opened_at = 0.0
        self._lock = threading.Lock()

    def call(self, fn: Callable[[], T], fallback: T) -> T:
        """fn() when the circuit allows it and it succeeds; otherwise fallback, at once."""
        try:
            return self.run(fn)
        except Exception:
            return fallback

    def run(self, fn: Callable[[], T]) -> T:
        """fn() when the circuit allows it; CircuitOpen when it does not. A failure re-raises."""
        if not self._allow():
            raise CircuitOpen(f"skipped: the index store failed {self.seconds_open():.1f} s ago; "
                              f"retrying after {self.open_s:g} s")
        try:
            result = fn()
        except Exception:
            self._record(False)
            raise
        self._record(True)
        return result

    def seconds_open(self) -> float:
        """How long ago the circuit last opened (0 while closed)."""
        with self._lock:
            return 0.0 if self.state is BreakerState.CLOSED else self.clock() - self._opened_at

    def retry_in(self) -> float:
        """Seconds until a call would be let through again (0 when one would be now)."""
        with self._lock:
            if self.state is not BreakerState.OPEN:
                return 0.0
            return max(0.0, self.open_s - (self.clock() - self._opened_at))

    def _allow(self) -> bool:
        with self._lock:
            if self.state is BreakerState.OPEN and self.clock() - self._opened_at >= self.open_s:
                self.state = BreakerState.HALF_OPEN
                return True
            return self.state is BreakerState.CLOSED

    def _record(self, ok: bool) -> None:
        with self._lock:
            if ok:
                self.state = BreakerState.CLOSED
                return
            self.failures += 1
            self.state, self._opened_at = BreakerState.OPEN, self.clock()
