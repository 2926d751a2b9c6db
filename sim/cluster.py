"""The event loop of a simulated cluster: arrivals, the router, workers' steps, KV transfers.

Lifecycle of a request (RequestState):

    WAITING --admitted, placed--> PREFILLING (on P, or on D itself) --P done--> TRANSFERRING
        --KV landed: D's first token--> DECODING --last token--> FINISHED
    WAITING --every decode worker full / prompt larger than any pool--> REFUSED

Placement is the router's own code: router/scoring.py `choose` for "prefix" (over exact cache
depths: the simulated index is never stale), router/least_load.py for "least_load", and the
router's turn-taking for "round_robin"; the request counts it sees are this router's in-flight
requests, as on the real router. A transfer that finds the decode pool full is prefilled on the
decode worker instead (the real receiver refuses the reservation and the router falls back).

Events are (time, sequence number, kind, payload) in one heap: ties go in the order they were
pushed, so a run is deterministic given its seed.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from loadtest.stats import OK, RequestRecord
from router.least_load import place_by_load
from router.scoring import Candidate, ScoringWeights, choose
from sim.costs import CostModel
from sim.worker import Emitted, Role, SimStep, SimWorker, prompt_hashes
from sim.workload import SimRequest

ROUTING = ("prefix", "least_load", "round_robin")
REFUSED_STATUS = "RESOURCE_EXHAUSTED"


class RequestState(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    TRANSFERRING = "transferring"
    DECODING = "decoding"
    FINISHED = "finished"
    REFUSED = "refused"


class EventKind(enum.Enum):
    ARRIVAL = 0
    STEP_DONE = 1
    TRANSFER_DONE = 2
    ROUTED = 3  # the request reaches the router's placement, request.overhead_s after its arrival


@dataclass(frozen=True)
class ClusterShape:
    """Workers and the router's policy: PlacementConfig's fields (router/config.py) that matter here."""

    num_prefill: int
    num_decode: int
    routing: str = "prefix"
    weights: ScoringWeights = field(default_factory=ScoringWeights)
    min_remote_prefill_tokens: int = 32
    max_in_flight_per_decode: int = 64

    def __post_init__(self) -> None:
        if self.num_decode < 1 or self.num_prefill < 0:
            raise ValueError("need >= 1 decode and >= 0 prefill workers, "
                             f"got {self.num_prefill}P+{self.num_decode}D")
        if self.routing not in ROUTING:
            raise ValueError(f"routing must be one of {', '.join(ROUTING)}, got {self.routing!r}")

    @property
    def label(self) -> str:
        if not self.num_prefill:
            return f"colocated x{self.num_decode}"
        return f"{self.num_prefill}P:{self.num_decode}D"


@dataclass
class _Track:
    req: SimRequest
    state: RequestState = RequestState.WAITING
    send_s: float = 0.0
    end_s: float = 0.0
    token_times: list[float] = field(default_factory=list)
    cached_tokens: int = 0
    prefill: SimWorker | None = None
    decode: SimWorker | None = None
    decode_cached_blocks: int = 0


@dataclass(frozen=True)
class SimResult:
    records: list[RequestRecord]
    duration_s: float  # simulated: first send to last end
    events: int
    steps: int
    step_seconds: float  # the sum of every worker's step durations
    preemptions: int
    leaked_blocks: int  # blocks still referenced at the end: 0 unless the simulator has a bug
    steps_trace: tuple[SimStep, ...] = ()  # every worker's steps in start order, with trace_steps=True


class Cluster:
    def __init__(self, shape: ClusterShape, costs: CostModel, seed: int = 0,
                 trace_steps: bool = False) -> None:
        self.shape, self.costs = shape, costs
        self.block_size = costs.hardware.block_size
        self.prefill = [SimWorker(f"prefill-{i}", Role.PREFILL, costs, seed, trace_steps)
                        for i in range(shape.num_prefill)]
        self.decode = [SimWorker(f"decode-{i}", Role.DECODE, costs, seed, trace_steps)
                       for i in range(shape.num_decode)]
        self.workers = {w.worker_id: w for w in (*self.prefill, *self.decode)}
        per_machine = costs.hardware.workers_per_machine
        self.machine = {w: i // per_machine for i, w in enumerate(self.workers)}  # worker id -> machine
        self.active = dict.fromkeys(self.workers, 0)
        self.rng = random.Random(f"{seed}/router")
        self.turns = {Role.PREFILL: itertools.count(), Role.DECODE: itertools.count()}
        self.now = 0.0
        self._heap: list[tuple[float, int, EventKind, object]] = []
        self._order = itertools.count()
        self._tracks: dict[str, _Track] = {}
        self._waiting_on: dict[int, list[SimRequest]] = {}
        self._finished: set[int] = set()
        self._reservations: dict[str, object] = {}

    # --- the loop -------------------------------------------------------------------------------
    def run(self, requests: Sequence[SimRequest]) -> SimResult:
        for r in requests:
            self._push(r.arrival_s, EventKind.ARRIVAL, r)
        events = 0
        while self._heap:
            self.now, _, kind, payload = heapq.heappop(self._heap)
            events += 1
            if kind is EventKind.ARRIVAL:
                self._arrive(payload)
            elif kind is EventKind.STEP_DONE:
                self._step_done(payload)
            elif kind is EventKind.ROUTED:
                self._route(payload)
            else:
                self._transfer_done(payload)
        return self._result(events)

    def _push(self, t: float, kind: EventKind, payload: object) -> None:
        heapq.heappush(self._heap, (t, next(self._order), kind, payload))

    def _kick(self, w: SimWorker) -> None:
        if not w.busy:
            duration = w.start_step(self.now)
            if duration is not None:
                self._share_the_machine(w)
                self._push(w.step_end, EventKind.STEP_DONE, w)

    def _share_the_machine(self, w: SimWorker) -> None:
        """w's new step and every step in flight on w's machine slow each other down over their overlap
        (CostModel's shared_machine_slowdown); a stretched step's earlier STEP_DONE goes stale."""
        slowdown = self.costs.step.shared_machine_slowdown
        if not slowdown:
            return
        mates = [o for o in self.workers.values()
                 if o is not w and o.busy and self.machine[o.worker_id] == self.machine[w.worker_id]]
        for other in mates:
            overlap = min(other.step_end, w.step_end) - self.now
            if overlap > 0:
                w.stretch(slowdown * overlap)
                other.stretch(slowdown * overlap)
                self._push(other.step_end, EventKind.STEP_DONE, other)

    # --- arrivals and placement -----------------------------------------------------------------
    def _arrive(self, req: SimRequest) -> None:
        if req.after is not None and req.after not in self._finished:
            self._waiting_on.setdefault(req.after, []).append(req)  # sent when that reply is complete
            return
        t = self._tracks[_rid(req)] = _Track(req, send_s=self.now)
        overhead = self.costs.request.overhead_s
        if overhead:
            self._push(self.now + overhead, EventKind.ROUTED, t)
        else:
            self._route(t)

    def _route(self, t: _Track) -> None:
        """Admission and placement; the prompt joins the computing worker's queue."""
        req = t.req
        if not self._admit(req):
            t.state, t.end_s = RequestState.REFUSED, self.now
            self._finish(t)
            return
        d, p = self._place(req, t)
        t.decode, t.prefill = d, p
        self.active[d.worker_id] += 1
        t.state = RequestState.PREFILLING
        computing = p or d
        if p is not None:
            self.active[p.worker_id] += 1
        computing.add(_rid(req), req.prompt, req.reply)
        self._kick(computing)

    def _admit(self, req: SimRequest) -> bool:
        bound = self.shape.max_in_flight_per_decode
        capacity = self.costs.hardware.num_blocks * self.block_size
        return len(req.prompt) < capacity and any(self.active[d.worker_id] < bound for d in self.decode)

    def _candidates(self, workers: list[SimWorker]) -> list[Candidate]:
        return [Candidate(w.worker_id, "", self.active[w.worker_id], w.used_block_fraction) for w in workers]

    def _place(self, req: SimRequest, t: _Track) -> tuple[SimWorker, SimWorker | None]:
        n = len(req.prompt)
        routing = self.shape.routing
        if routing == "prefix":
            hashes = prompt_hashes(req.prompt, self.block_size)
            held = {wid: w.cached_blocks(hashes) for wid, w in self.workers.items()}
            decode, prefill = self._candidates(self.decode), self._candidates(self.prefill)
            c = choose(n, self.block_size, decode, prefill, held, self.shape.weights, self.rng)
            t.decode_cached_blocks = c.decode_cached_blocks
            return self.workers[c.decode.worker_id], c.prefill and self.workers[c.prefill.worker_id]
        remote = bool(self.prefill) and n >= self.shape.min_remote_prefill_tokens
        if routing == "least_load":
            d, p = place_by_load(self._candidates(self.prefill), self._candidates(self.decode), n,
                                 self.shape.min_remote_prefill_tokens, self.rng)
            return self.workers[d.worker_id], p and self.workers[p.worker_id]
        d = self.decode[next(self.turns[Role.DECODE]) % len(self.decode)]
        return d, self.prefill[next(self.turns[Role.PREFILL]) % len(self.prefill)] if remote else None

    # --- workers' steps and transfers -----------------------------------------------------------
    def _step_done(self, w: SimWorker) -> None:
        if not w.busy or self.now != w.step_end:
            return  # stale: the step was stretched, and a later event ends it
        for e in w.finish_step():
            t = self._tracks[e.request_id]
            if w.role is Role.PREFILL:
                self._prefilled(t, e)
            else:
                self._token(t, e)
        self._kick(w)

    def _prefilled(self, t: _Track, e: Emitted) -> None:
        assert t.prefill is not None and t.decode is not None
        self.active[t.prefill.worker_id] -= 1
        t.cached_tokens = e.cached_tokens
        reservation = t.decode.reserve(e.request_id, t.req.prompt, t.decode_cached_blocks)
        if reservation is None:  # the receiver's pool is full: the router prefills on D
            t.prefill = None
            t.decode.add(e.request_id, t.req.prompt, t.req.reply)
            self._kick(t.decode)
            return
        t.state = RequestState.TRANSFERRING
        self._reservations[e.request_id] = reservation
        sent = len(t.req.prompt) - reservation.num_cached_blocks * self.block_size
        self._push(self.now + self.costs.transfer_s(sent), EventKind.TRANSFER_DONE, t)

    def _transfer_done(self, t: _Track) -> None:
        assert t.decode is not None
        reservation = self._reservations.pop(_rid(t.req))
        cached = t.cached_tokens
        self._token(t, t.decode.resume(reservation, t.req.reply))
        t.cached_tokens = cached  # the computing worker's (P's) hit is the prompt's hit
        self._kick(t.decode)

    def _token(self, t: _Track, e: Emitted) -> None:
        if not t.token_times:
            t.state = RequestState.DECODING
            if t.prefill is None:
                t.cached_tokens = e.cached_tokens
        t.token_times.append(self.now)
        if e.finished:
            t.state, t.end_s = RequestState.FINISHED, self.now
            self.active[t.decode.worker_id] -= 1
            self._finish(t)

    def _finish(self, t: _Track) -> None:
        self._finished.add(t.req.index)
        for follower in self._waiting_on.pop(t.req.index, ()):
            self._push(max(self.now, follower.arrival_s), EventKind.ARRIVAL, follower)

    # --- the outcome ----------------------------------------------------------------------------
    def _result(self, events: int) -> SimResult:
        records = [_record(t) for t in sorted(self._tracks.values(), key=lambda t: t.req.index)]
        start = min((r.send_s for r in records), default=0.0)
        end = max((r.end_s for r in records), default=0.0)
        workers = self.workers.values()
        trace = sorted((s for w in workers for s in w.trace or ()), key=lambda s: s.start_s)
        return SimResult(records, end - start, events, sum(w.steps for w in workers),
                         sum(w.step_seconds for w in workers), sum(w.preemptions for w in workers),
                         sum(len(w.leaked_blocks()) for w in workers), tuple(trace))


def _rid(req: SimRequest) -> str:
    return f"r{req.index}"


def _record(t: _Track) -> RequestRecord:
    req = t.req
    ok = t.state is RequestState.FINISHED
    usage = {"prompt_tokens": len(req.prompt), "cached_tokens": t.cached_tokens,
             "completion_tokens": len(t.token_times)} if ok else None
    return RequestRecord(req.index, t.send_s, t.end_s, OK if ok else REFUSED_STATUS, tuple(t.token_times),
                         (1,) * len(t.token_times), usage,
                         prefill_worker=t.prefill.worker_id if t.prefill else None,
                         decode_worker=t.decode.worker_id if t.decode else None,
                         finish_reason="length" if ok else None, max_tokens=len(req.reply), kind=req.kind,
                         conversation=req.conversation, turn=req.turn)


def simulate(requests: Sequence[SimRequest], shape: ClusterShape, costs: CostModel,
             seed: int = 0, trace_steps: bool = False) -> SimResult:
    return Cluster(shape, costs, seed, trace_steps).run(requests)
