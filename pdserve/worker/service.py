"""What every worker serves whatever its role (the Worker service: Abort, Status, Audit), and the
pieces a role's own services run on (prefill_worker/service.py, decode_worker/service.py).

    WorkerParts   the engine, its loop, metrics, the serving state and token totals, the
                  worker's SecurityConfig and ConnectionPolicy: handed to a role when it serves
    ServingState  taking work -> draining (serving False: new work refused, work under way
                  finishes) | out of service (failing: its engine failed step after step; every
                  call refused, UNAVAILABLE naming why)
    Status        one WorkerStatus from the engine's counters (read without its lock), the totals,
                  the KV audit's totals and what the role adds (role.fill_status)
    Audit         the KV audit of this worker's cache (pdserve/engine/audit.py), shared with the
                  background scrubber (scrubber.py)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc

from pdserve.engine.audit import AuditReport, KVAuditor
from pdserve.engine.block_pool import TierUsage
from pdserve.engine.events import Tier
from pdserve.engine.llm_engine import InvalidRequestError, LLMEngine
from pdserve.engine.sequence import SamplingParams, Usage
from pdserve.grpc_options import ConnectionPolicy
from pdserve.security import SecurityConfig
from pdserve.worker.convert import sampling_from_proto
from pdserve.worker.engine_loop import EngineLoop
from pdserve.worker.metrics import WorkerMetrics
from protos.pdserve.v1 import worker_pb2, worker_pb2_grpc


@dataclass
class TokenTotals:
    """Since start, over requests that finished on this worker (read by Status and /metrics)."""

    prompt: int = 0
    cached: int = 0
    generated: int = 0
    preemptions: int = 0
    host_cached: int = 0
    disk_cached: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count(self, usage: Usage, generated: int) -> None:
        with self._lock:
            self.prompt += usage.prompt_tokens
            self.cached += usage.cached_tokens
            self.generated += generated
            self.preemptions += usage.preemptions
            self.host_cached += usage.host_cached_tokens
            self.disk_cached += usage.disk_cached_tokens

    def fill(self, status: worker_pb2.WorkerStatus) -> None:
        with self._lock:
            status.prompt_tokens_total, status.cached_tokens_total = self.prompt, self.cached
            status.generated_tokens_total, status.preemptions_total = self.generated, self.preemptions
            status.host_cached_tokens_total = self.host_cached
            status.disk_cached_tokens_total = self.disk_cached


class ServingState:
    """Whether this worker takes new work (see the module docstring)."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.serving = True  # False while draining or stopping
        self.failing: str | None = None  # why the worker took itself out of service, once it has

    @property
    def taking_work(self) -> bool:
        return self.serving and self.failing is None

    def refuse_if_failing(self, context) -> None:
        if self.failing is not None:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"worker {self.worker_id} is out of service: "
                                                       f"{self.failing}; send it to another worker")

    def refuse_if_draining(self, context) -> None:
        self.refuse_if_failing(context)
        if not self.serving:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"worker {self.worker_id} is draining and takes no "
                                                       "new requests; send it to another worker")


@dataclass(frozen=True)
class WorkerParts:
    """What a role's services run on."""

    engine: LLMEngine
    loop: EngineLoop
    metrics: WorkerMetrics
    state: ServingState
    totals: TokenTotals
    security: SecurityConfig
    connections: ConnectionPolicy


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, parts: WorkerParts, identity: worker_pb2.WorkerStatus, auditor: KVAuditor,
                 fill_role_status: Callable[[worker_pb2.WorkerStatus], None]) -> None:
        self.parts, self.identity, self.auditor = parts, identity, auditor
        self._fill_role_status = fill_role_status

    def Abort(self, request, context):  # noqa: N802
        return worker_pb2.AbortReply(found=self.parts.loop.abort(request.request_id))

    def Status(self, request, context):  # noqa: N802
        return self.status()

    def status(self) -> worker_pb2.WorkerStatus:
        engine = self.parts.engine
        load = engine.load()  # never waits behind an engine step
        status = worker_pb2.WorkerStatus(
            active_requests=load.running, waiting_requests=load.waiting, num_blocks=load.num_blocks,
            free_blocks=load.free_blocks, cached_blocks=load.cached_blocks, used_blocks=load.used_blocks,
            parked_transfers=load.parked_transfers, model_fingerprint=engine.fingerprint,
            block_size=engine.block_size, serving=self.parts.state.taking_work)
        self.parts.totals.fill(status)
        fill_tiers(status, load.tiers)
        audit = self.auditor.totals()
        status.kv_audited_blocks_total, status.kv_audit_mismatches_total = audit.checked, audit.mismatched
        status.kv_audit_evicted_total, status.kv_audit_seconds_total = audit.evicted, audit.seconds
        loop = self.parts.loop
        status.steps_total, status.step_seconds_total = loop.steps_total, loop.step_seconds_total
        status.kernels.extend(worker_pb2.KernelChoice(setting=c.setting, kernel=c.kernel, reason=c.reason)
                              for c in engine.kernels.all())
        self._fill_role_status(status)
        status.MergeFrom(self.identity)
        return status

    def Steps(self, request, context):  # noqa: N802
        return self.steps(request.after)

    def steps(self, after: int) -> worker_pb2.StepsReply:
        loop = self.parts.loop
        reply = worker_pb2.StepsReply(steps_total=loop.steps_total)  # first: a later step is the next call's
        for r in loop.steps_after(after, up_to=reply.steps_total):
            shape = r.shape
            step = reply.steps.add(number=r.number, seconds=r.seconds, decode_seqs=shape.decode_seqs,
                                   decode_context=shape.decode_context, started_at=r.started_at)
            step.prefill_tokens.extend(n for n, _ in shape.prefill)
            step.prefill_start.extend(c for _, c in shape.prefill)
            if r.gap_s is not None:
                step.gap_seconds = r.gap_s
        return reply

    def ResyncIndex(self, request, context):  # noqa: N802
        """Ask the publisher to replace this worker's index entries with the pool's cached blocks
        (on its own thread; the reply does not wait for it)."""
        engine = self.parts.engine
        engine.publisher.resync()
        return worker_pb2.ResyncIndexReply(cached_blocks=engine.load().cached_blocks)

    def Audit(self, request, context):  # noqa: N802
        """KV audit of this worker's cache (engine/audit.py); it stops starting new recomputes at 90%
        of the call's deadline, and says so with complete=false."""
        remaining = context.time_remaining()  # NOTE: about 2**63 s when the caller set no deadline
        stop_at = time.monotonic() + 0.9 * remaining if remaining is not None and remaining < 1e9 else None
        report = self.auditor.audit(request.sample, stop_at)
        return _audit_reply(self.identity.worker_id, report)


def _audit_reply(worker_id: str, r: AuditReport) -> worker_pb2.AuditReply:
    return worker_pb2.AuditReply(
        worker_id=worker_id, cached_blocks=r.cached_blocks, checked=r.checked, exact=r.exact,
        mismatched=r.mismatched, evicted=r.evicted, evicted_in_use=r.evicted_in_use, skipped=r.skipped,
        rule=r.rule, elapsed_ms=r.elapsed_s * 1e3, max_abs_diff=r.max_abs_diff, max_rel_diff=r.max_rel_diff,
        complete=r.complete, recomputed_tokens=r.recomputed_tokens)


# --- helpers of every role's calls ------------------------------------------------------------------
def on_call_end(context, callback: Callable[[], object]) -> None:
    """Run callback when the call ends. NOTE: add_callback returns False, and never calls it,
    when the call has already ended (a client that cancelled at once): run it now instead."""
    if not context.add_callback(callback):
        callback()


def check_request_id(request_id: str) -> None:
    if not request_id:
        raise InvalidRequestError("request_id is empty: give each request an id")


def sampling_or_abort(proto, context) -> SamplingParams:
    """The request's sampling values, or INVALID_ARGUMENT naming the bad field."""
    try:
        return sampling_from_proto(proto)
    except ValueError as e:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))


def fill_tiers(status: worker_pb2.WorkerStatus, tiers: Sequence[TierUsage]) -> None:
    """The host and disk tiers' capacity and use (the device pool's are num_blocks/used_blocks)."""
    for t in tiers:
        if t.tier is Tier.HOST:
            status.host_blocks, status.host_used_blocks = t.capacity_blocks, t.used_blocks
        elif t.tier is Tier.DISK:
            status.disk_blocks, status.disk_used_blocks = t.capacity_blocks, t.used_blocks
