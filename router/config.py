"""The router's frozen configuration that `pdserve up` composes into its ClusterSpec (deploy/config.py).

Pure: dataclasses and the pure scorer only, no gRPC, so the topology file and `pdserve --help` read
the router's own defaults and choices without loading the router. RouterConfig (router/server.py)
holds these next to what only a running server needs (security, connections, threads); the request
limits are router/limits.py's RequestLimits.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.field_error import FieldError
from pdserve.settings import not_a_setting, setting
from router.scoring import ScoringWeights

# --routing: which workers a request goes to (router/placement.py).
ROUTING_POLICIES = ("prefix", "least_load", "round_robin")


@dataclass(frozen=True)
class PlacementConfig:
    """How the router places a request on a decode worker (and maybe a prefill worker)."""

    routing: str = setting("prefix", flag="--routing", key="router.routing", choices=ROUTING_POLICIES,
                           help="routing policy: prefix = KV-aware (send requests where their prefix is "
                                "cached, prefill on the decode worker when it pays); least_load = fewest "
                                "requests in flight; round_robin = in turn")
    weights: ScoringWeights = not_a_setting(default_factory=ScoringWeights,
                                            why="the cost model's prices (router/scoring.py), measured, "
                                                "not an operator's choice")
    min_remote_prefill_tokens: int = setting(
        32, flag="--min-remote-prefill-tokens", key="router.min_remote_prefill_tokens", metavar="N",
        help="least_load/round_robin: prompts shorter than N tokens are prefilled on the decode worker, "
             "with no KV transfer")
    max_in_flight_per_decode: int = setting(
        64, flag="--max-in-flight-per-decode", key="router.max_in_flight_per_decode", metavar="N",
        help="admission control per decode worker, on the load every router shares; more is refused with "
             "RESOURCE_EXHAUSTED")

    def __post_init__(self) -> None:
        if self.routing not in ROUTING_POLICIES:
            raise FieldError("routing", f"must be one of {', '.join(ROUTING_POLICIES)}", self.routing)


@dataclass(frozen=True)
class RequestDeadlines:
    """The router's deadlines, for a request and for its remote prefill.

    default_timeout_s: a request's deadline when its client sets none. The remote prefill phase
    gets its own deadline: prefill_deadline_fraction of the request's remaining time, at most
    prefill_timeout_s, so that when a prefill worker or its transfer stalls, the fallback (prefill
    on the decode worker) still has the rest of the time to answer in."""

    default_timeout_s: float = not_a_setting(300.0, why="the router's deadline for a client that sets "
                                                        "none; clients set their own")
    prefill_deadline_fraction: float = setting(
        0.5, flag="--prefill-deadline-fraction", key="router.prefill_deadline_fraction", metavar="F",
        help="share of a request's remaining time its remote prefill may take before the router prefills "
             "on the decode worker instead, so a stalled prefill worker or KV transfer still leaves time to "
             "answer")
    prefill_timeout_s: float = setting(60.0, flag="--prefill-timeout-s", key="router.prefill_timeout_s",
                                       metavar="SECONDS",
                                       help="the remote prefill's deadline at most, whatever the request's")

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

    limit: int = setting(3, flag="--migration-limit", key="router.migration_limit", metavar="N",
                         help="times one request's stream may move to another decode worker when its own "
                              "dies, drains past its grace or fails mid-stream (the client sees one "
                              "unbroken stream); 0 = never")

    def __post_init__(self) -> None:
        if self.limit < 0:
            raise FieldError("limit", "must be >= 0 moves per request (0: never migrate)", self.limit)
