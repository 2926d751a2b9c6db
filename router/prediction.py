"""The router checks its own predictions: what the prefix index said a worker would reuse, against
what the worker reused.

Pure: no I/O; the clock is a parameter. For every finished request placed by prefix (the only
policy that asks the index), the router records on the worker that computed the prompt (the
prefill worker, or the decode worker when it prefilled):

    predicted   cached tokens the index promised: usable leading blocks x block size
    reused      cached tokens the worker reports in the request's usage

A worker's accuracy over its last `window` requests is 1 - sum|predicted - reused| / sum(max of
the two): 1 when the index is right, 0 when it promises blocks the worker lacks or misses blocks
the worker has. Both errors matter: over-prediction sends requests to a worker that recomputes;
under-prediction (its entries lost from Redis) sends them away from the worker that holds them.

    accuracy < threshold over >= min_samples requests, and no resync asked of that worker for
    cooldown_s  ──▶  resync: the worker republishes its cached blocks (Worker.ResyncIndex), and
                     its window starts again (the old samples judged the old entries)

A request where neither side saw a cache (0 and 0) still counts, as a correct prediction.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.field_error import FieldError


@dataclass(frozen=True)
class PredictionCheck:
    window: int = 32  # the requests a worker's accuracy is measured over
    min_samples: int = 8  # fewer: no verdict yet
    threshold: float = 0.7  # accuracy below this asks the worker to resync its index entries
    cooldown_s: float = 30.0  # at most one resync per worker per this long

    def __post_init__(self) -> None:
        if self.window < 1 or not 1 <= self.min_samples <= self.window:
            raise FieldError("min_samples", f"must be in [1, window={self.window}]", self.min_samples)
        if not 0.0 <= self.threshold <= 1.0:
            raise FieldError("threshold", "must be in [0, 1]", self.threshold)
        if self.cooldown_s < 0:
            raise FieldError("cooldown_s", "must be >= 0", self.cooldown_s)


@dataclass
class _Window:
    samples: deque = field(default_factory=deque)
    last_resync: float | None = None


class PredictionTracker:
    def __init__(self, check: PredictionCheck | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.check = check or PredictionCheck()
        self.clock = clock
        self._windows: dict[str, _Window] = {}
        self._lock = threading.Lock()  # the router's request threads all record

    def record(self, worker_id: str, predicted: int, reused: int) -> bool:
        """Add one request's pair; True when the worker should resync now (counted as asked)."""
        with self._lock:
            return self._record(worker_id, predicted, reused)

    def _record(self, worker_id: str, predicted: int, reused: int) -> bool:
        w = self._windows.setdefault(worker_id, _Window(deque(maxlen=self.check.window)))
        w.samples.append((predicted, reused))
        accuracy = self._accuracy(w)
        if accuracy is None or accuracy >= self.check.threshold:
            return False
        now = self.clock()
        if w.last_resync is not None and now - w.last_resync < self.check.cooldown_s:
            return False
        w.last_resync = now
        w.samples.clear()
        return True

    def accuracy(self, worker_id: str) -> float | None:
        """None until the worker has min_samples requests in its window."""
        with self._lock:
            w = self._windows.get(worker_id)
            return self._accuracy(w) if w is not None else None

    def _accuracy(self, w: _Window) -> float | None:
        if len(w.samples) < self.check.min_samples:
            return None
        return accuracy_of(list(w.samples))


def accuracy_of(samples: list[tuple[int, int]]) -> float:
    scale = sum(max(p, r) for p, r in samples)
    if scale == 0:
        return 1.0
    return 1.0 - sum(abs(p - r) for p, r in samples) / scale
