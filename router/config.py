"""The router's frozen configuration that `pdserve up` composes into its ClusterSpec (deploy/config.py).

Pure: dataclasses and the pure scorer only, no gRPC, so the topology file and `pdserve --help` read
the router's own defaults and choices without loading the router. RouterConfig (router/server.py)
holds these next to what only a running server needs (security, connections, threads); the request
limits are router/limits.py's RequestLimits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.field_error import FieldError
from router.scoring import ScoringWeights

# --routing: which workers a request goes to (router/placement.py).
ROUTING_POLICIES = ("prefix", "least_load", "round_robin")


@dataclass(frozen=True)
class PlacementConfig:
    """How the router places a request on a decode worker (and maybe a prefill worker)."""

    routing: str = "prefix"
    weights: ScoringWeights = field(default_factory=ScoringWeights)
    min_remote_prefill_tokens: int = 32  # least_load / round_robin: shorter prompts stay on D
    max_in_flight_per_decode: int = 64

    def __post_init__(self) -> None:
        if self.routing not in ROUTING_POLICIES:
            raise FieldError("routing", f"must be one of {', '.join(ROUTING_POLICIES)}", self.routing)


@dataclass(frozen=True)
class RequestDeadlines:
    """default_timeout_s: a request's deadline when its client sets none. The remote prefill phase
    gets its own deadline: prefill_deadline_fraction of the request's remaining time, at most
    prefill_timeout_s, so that when a prefill worker or its transfer stalls, the fallback (prefill
    on the decode worker) still has the rest of the time to answer in."""

    default_timeout_s: float = 300.0
    prefill_deadline_fraction: float = 0.5
    prefill_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if not 0 < self.prefill_deadline_fraction < 1:
            raise FieldError("prefill_deadline_fraction", "must be in (0, 1) so the fallback keeps some of "
                             "the request's time", self.prefill_deadline_fraction)
        for name in ("prefill_timeout_s", "default_timeout_s"):
            if not getattr(self, name) > 0:
                raise FieldError(name, "must be > 0 seconds", getattr(self, name))


@dataclass(frozen=True)
class MigrationPolicy:
    """What the router does when a decode stream breaks after tokens reached the client (its worker
    died, drained past its grace, or failed): it continues the stream on another decode worker with
    prompt + the tokens so far (router/service.py), at most `limit` times per request. 0: never; the
    stream ends with the worker's status, as before migration existed."""

    limit: int = 3

    def __post_init__(self) -> None:
        if self.limit < 0:
            raise FieldError("limit", "must be >= 0 moves per request (0: never migrate)", self.limit)
