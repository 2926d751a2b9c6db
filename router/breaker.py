"""A circuit breaker for the prefix index: Redis down must cost requests almost nothing.

    CLOSED     calls go through; a failure (error or timeout) opens the circuit
    OPEN       calls are skipped at once (the caller routes by load) for open_s seconds
    HALF_OPEN  one call is let through: success closes the circuit, failure re-opens it

Pure: the clock is a parameter.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


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
        if not self._allow():
            return fallback
        try:
            result = fn()
        except Exception:
            self._record(False)
            return fallback
        self._record(True)
        return result

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
