"""Load figures shared by every router replica: the worker's own report, plus this router's delta.

Pure: no I/O. Each worker publishes its load with its heartbeat (pdserve/worker/presence.py, every
heartbeat_s, 1 s by default) into Redis, numbered (epoch, seq); each router's worker directory
reads it every refresh (0.5 s by default). Between two reports a router knows one thing more: what
it placed, and saw finish, itself since it read the last one. So each router scores a worker by

    estimate = max(running + waiting as reported + (in flight now - in flight when the report was read),
                   in flight now)

The second term is a floor: a request this router placed after the worker took its report, but
before the router read it, is in neither figure's difference. With one router and no report (a
test directory, or Redis down) the estimate is the router's own in-flight count, as before.

NOTE: the heartbeat and not a faster channel. What another router placed reaches this one within
one heartbeat plus one refresh (at most 1.5 s at the defaults); what this router placed counts at
once. A request on SmolLM2 on CPU lasts seconds, so a 1.5 s lag mis-scores only the placements of
the other routers in that window; a faster channel would cost a Redis write per placement.
Both routers read the same report, so their status tables agree on it within one heartbeat
(tests/cluster/test_router_replicas.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class LoadReport:
    """One heartbeat's load figures, as the worker wrote them (pdserve/worker/actor.py _load)."""

    epoch: int
    seq: int
    running: int
    waiting: int
    used_blocks: int
    free_blocks: int

    @classmethod
    def of(cls, fields: Mapping[str, int]) -> LoadReport | None:
        """The report in a registry load hash; None when there is none (expired, or never written)."""
        if "seq" not in fields:
            return None
        return cls(epoch=fields.get("epoch", 0), seq=fields["seq"], running=fields.get("active", 0),
                   waiting=fields.get("waiting", 0), used_blocks=fields.get("used_blocks", 0),
                   free_blocks=fields.get("free_blocks", 0))

    @property
    def queued(self) -> int:
        """Sequences the worker holds: running in its batch, or waiting for a slot."""
        return self.running + self.waiting

    def same_as(self, other: LoadReport | None) -> bool:
        return other is not None and (self.epoch, self.seq) == (other.epoch, other.seq)


@dataclass(frozen=True)
class SeenReport:
    """A report, and how many requests this router had in flight on the worker when it read it."""

    report: LoadReport
    in_flight_when_read: int


def note_report(seen: SeenReport | None, report: LoadReport | None, in_flight: int) -> SeenReport | None:
    """What the directory keeps after reading `report`: the same baseline when it is the report
    already seen (a refresh between two heartbeats), a new one when it is new."""
    if report is None:
        return None
    if seen is not None and report.same_as(seen.report):
        return seen
    return SeenReport(report, in_flight)


def estimated_load(seen: SeenReport | None, in_flight: int) -> int:
    """Sequences on the worker, from every router: the report plus this router's change since."""
    if seen is None:
        return in_flight
    return max(seen.report.queued + in_flight - seen.in_flight_when_read, in_flight)
