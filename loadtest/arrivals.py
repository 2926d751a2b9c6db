"""When requests are sent: an open loop (Poisson arrivals at a rate) or a closed loop (a fixed
number of requests in flight). Pure: the schedule is offsets in seconds from the start of the
run, drawn from a seeded rng; the runner does the waiting.

Open loop: request i is due at offset t_i, with t_0 = 0 and independent exponential gaps of
mean 1/rate (a Poisson process), whether or not earlier requests have finished. A rate of
inf sends everything at once. Closed loop: `concurrency` senders each send their next
request as soon as their previous one ends, so at most `concurrency` are ever in flight.
Both stop at the run's bounds (a request count and a duration).
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Poisson:
    rate: float  # requests per second; inf = all at once

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"--rate must be > 0 requests/s, got {self.rate}")

    def describe(self) -> dict[str, object]:
        return {"mode": "poisson", "rate": None if math.isinf(self.rate) else self.rate}


@dataclass(frozen=True)
class ClosedLoop:
    concurrency: int  # requests in flight at once

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"--concurrency must be >= 1, got {self.concurrency}")

    def describe(self) -> dict[str, object]:
        return {"mode": "closed_loop", "concurrency": self.concurrency}


Arrivals = Poisson | ClosedLoop


@dataclass(frozen=True)
class Bounds:
    """A run sends at most `requests` requests and starts none after `duration_s` seconds."""

    requests: int
    duration_s: float | None = None  # None: bounded by the count only

    def __post_init__(self) -> None:
        if self.requests < 1:
            raise ValueError(f"--requests must be >= 1, got {self.requests}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"--duration must be > 0 seconds, got {self.duration_s}")


def poisson_offsets(rate: float, rng: random.Random) -> Iterator[float]:
    """Send times, in seconds from the start: 0, then cumulative exponential gaps of mean 1/rate."""
    if math.isinf(rate):
        yield from itertools.repeat(0.0)
    t = 0.0
    while True:
        yield t
        t += rng.expovariate(rate)


def scheduled_offsets(rate: float, rng: random.Random, bounds: Bounds) -> list[float]:
    """The offsets an open-loop run sends at: the first bounds.requests, those before the duration."""
    offsets = itertools.islice(poisson_offsets(rate, rng), bounds.requests)
    if bounds.duration_s is None:
        return list(offsets)
    return list(itertools.takewhile(lambda t: t < bounds.duration_s, offsets))
