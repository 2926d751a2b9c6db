"""The Worker gRPC service: Prefill, Decode, Abort, Status over one engine loop.

Prefill (remote prefill for a decode target), the one orchestration production and the
transfer tests (tests/transfer/rig.py) run:
    register the outgoing transfer -> submit(max_tokens=1) -> each layer's blocks are pinned
    and stream out as they are computed -> first token sampled -> END -> wait for the
    receiver's reply -> unpin the blocks (they stay in this worker's prefix cache).
    The call ending early (cancelled, past its deadline) aborts the transfer first, then the
    request; a preempted request aborts its transfer (pdserve/transfer/sender.py). Either way
    no END is sent after the abort, so the decode worker discards everything it received.
    A failed transfer fails the call with the transfer's FailureKind as its status code, except
    that CANCELLED and DEADLINE_EXCEEDED become ABORTED: those two codes would say that the
    Prefill call itself was cancelled or ran out of time, and callers do not retry those.
Decode:
    resume the parked KV with the prefill worker's first token, or prefill here when told
    to or when no KV arrived (a failed transfer: recompute, so output stays exact) -> stream.
A cancelled or expired call aborts the request on this worker: its blocks are freed at once.
Audit: the KV audit of this worker's cache (engine/audit.py), shared with the background scrubber.
KV channels to decode workers dial with this worker's SecurityConfig (TLS, cluster secret).
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace

import grpc

from pdserve.engine.audit import AuditReport, KVAuditor
from pdserve.engine.llm_engine import InvalidRequestError, LLMEngine
from pdserve.security import SecurityConfig
from pdserve.transfer.errors import FailureKind, TransferFailed
from pdserve.transfer.faults import FaultInjector
from pdserve.transfer.grpc_transport import GrpcKVChannel
from pdserve.transfer.receiver import KVReceiver
from pdserve.transfer.sender import KVChannel, LayerwiseSender, OutgoingTransfer
from pdserve.worker.convert import (
    rng_state_from_bytes,
    rng_state_to_bytes,
    sampling_from_proto,
    usage_to_proto,
)
from pdserve.worker.engine_loop import EngineLoop, RequestStream
from pdserve.worker.metrics import TRANSFER_OK, WorkerMetrics
from pdserve.worker.peers import AnyDecodeTarget, DecodeTargets
from protos.pdserve.v1 import worker_pb2, worker_pb2_grpc

DEFAULT_TIMEOUT_S = 60.0
MAX_KV_PEER_CHANNELS = 64  # KV channels a prefill worker keeps open, one per decode worker address
_RETRYABLE_AS_ABORTED = {FailureKind.CANCELLED, FailureKind.DEADLINE_EXCEEDED}


@dataclass
class TokenTotals:
    """Since start, over requests that finished on this worker (read by Status and /metrics)."""

    prompt: int = 0
    cached: int = 0
    generated: int = 0
    preemptions: int = 0


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, engine: LLMEngine, loop: EngineLoop, sender: LayerwiseSender, receiver: KVReceiver,
                 identity: worker_pb2.WorkerStatus, metrics: WorkerMetrics | None = None, *,
                 transfer_timeout_s: float | None = None, faults: FaultInjector | None = None,
                 security: SecurityConfig | None = None,
                 dial: Callable[[str], KVChannel] | None = None,
                 decode_targets: DecodeTargets | None = None, auditor: KVAuditor | None = None) -> None:
        self.engine, self.loop, self.sender, self.receiver = engine, loop, sender, receiver
        self.auditor = auditor or KVAuditor(engine)
        self.transfer_timeout_s = transfer_timeout_s  # None: the Prefill call's remaining time
        self.faults = faults  # None (the default): channels are not wrapped at all
        self.security = security  # how KV channels dial decode workers; None: plaintext
        # How a KV channel to a decode worker address is made: gRPC, unless a test hands in the
        # in-process loopback transport (the same orchestration runs over either).
        self._dial = dial or (lambda target: GrpcKVChannel(target, self.security))
        self.decode_targets = decode_targets or AnyDecodeTarget()  # where Prefill may push KV
        self.identity = identity
        self.metrics = metrics or WorkerMetrics()
        self.serving = True
        self.failing: str | None = None  # why the worker took itself out of service, once it has
        self.bytes_sent = 0
        self.totals = TokenTotals()
        self.send_outcomes: Counter[str] = Counter()
        # NOTE: one channel per decode worker address, least recently used first. A decode worker
        # that restarts comes back on a new port, so without a bound this grows by one channel
        # per restart for the life of the process.
        self._channels: OrderedDict[str, KVChannel] = OrderedDict()
        self._lock = threading.Lock()

    # --- Prefill ----------------------------------------------------------------------------
    def Prefill(self, request, context):  # noqa: N802
        self._refuse_if_draining(context)
        rid, prompt = request.request_id, list(request.prompt_token_ids)
        sampling = _sampling_or_abort(request.sampling, context)
        if not rid:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty: give each request an id")
        if not self.decode_targets.allows(request.decode_target):
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          f"decode_target {request.decode_target!r} is not a live decode worker in the "
                          "registry; this worker pushes KV only to registered decode workers")
        started = time.perf_counter()
        transfer = self.sender.start(rid, prompt, request.target_cached_blocks,
                                     self._channel(request.decode_target), self._push_timeout(context),
                                     cache_salt=request.cache_salt)
        try:
            try:
                stream = self.loop.submit(prompt, replace(sampling, max_tokens=1, stop=()), rid,
                                          detokenize=False, cache_salt=request.cache_salt)
            except (InvalidRequestError, ValueError) as e:
                transfer.abort(FailureKind.INVALID_ARGUMENT, str(e))
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            _on_call_end(context, lambda: self._cancel_prefill(transfer, rid))
            return self._finish_prefill(rid, stream, transfer, started, context)
        finally:
            self.sender.finish(rid)

    def _push_timeout(self, context) -> float:
        timeout = context.time_remaining() or DEFAULT_TIMEOUT_S
        return timeout if self.transfer_timeout_s is None else min(timeout, self.transfer_timeout_s)

    def _cancel_prefill(self, transfer: OutgoingTransfer, rid: str) -> None:
        """The Prefill call ended (cancelled, past its deadline, or answered). NOTE: the transfer
        first, so that no block is let go of while the sender could still send END after it."""
        transfer.abort(FailureKind.CANCELLED, "the Prefill call ended (cancelled, or past its deadline)")
        self.loop.abort(rid)

    def _finish_prefill(self, rid: str, stream: RequestStream, transfer: OutgoingTransfer, started: float,
                        context):
        last = next(o for o in stream if o.finished)
        if last.finish_reason in ("abort", "error"):
            self._end_prefill_early(rid, last.finish_reason, transfer, context)
        computed = time.perf_counter()
        transfer.close()
        self.metrics.ttft.observe(computed - started)
        try:
            push = transfer.wait()
        except TransferFailed as e:
            self._count_send(e.kind.value)
            context.abort(_prefill_failure_code(e.kind),
                          f"KV transfer to the decode worker failed ({e.kind.value}): {e.message}")
        self._count_send(TRANSFER_OK)
        self._count_finished(last.usage, generated=0)
        with self._lock:
            self.bytes_sent += push.bytes_sent
        return worker_pb2.PrefillReply(
            first_token=last.new_token_ids[0], rng_state=rng_state_to_bytes(last.rng_state),
            usage=usage_to_proto(last.usage), bytes_sent=push.bytes_sent, blocks_sent=push.blocks_written,
            prefill_ms=(computed - started) * 1e3, transfer_ms=(time.perf_counter() - computed) * 1e3)

    def _end_prefill_early(self, rid: str, finish_reason: str, transfer: OutgoingTransfer, context) -> None:
        """The request ended without its first token: aborted (the call ended, or preempted) or
        failed in the engine. Its transfer is aborted; the call fails with why."""
        if finish_reason == "error":
            self._count_send(transfer.abort(FailureKind.INTERNAL, "the engine failed").kind.value)
            context.abort(grpc.StatusCode.INTERNAL, f"the engine failed while prefilling {rid} (see the "
                          "worker's log); the router prefills it elsewhere")
        failure = transfer.abort(FailureKind.CANCELLED, f"request {rid} was aborted during prefill")
        self._count_send(failure.kind.value)
        context.abort(_prefill_failure_code(failure.kind),
                      f"KV transfer to the decode worker did not complete ({failure.kind.value}): "
                      f"{failure.message}")

    def _count_send(self, outcome: str) -> None:
        with self._lock:
            self.send_outcomes[outcome] += 1

    def _count_finished(self, usage, generated: int) -> None:
        with self._lock:
            self.totals.prompt += usage.prompt_tokens
            self.totals.cached += usage.cached_tokens
            self.totals.generated += generated
            self.totals.preemptions += usage.preemptions

    def _channel(self, target: str) -> KVChannel:
        """The KV channel to target; past MAX_KV_PEER_CHANNELS peers the least recently used is
        closed (its peer is most likely a decode worker that restarted on another port)."""
        evicted = []
        with self._lock:
            if target in self._channels:
                self._channels.move_to_end(target)
            else:
                channel = self._dial(target)
                self._channels[target] = channel if self.faults is None else self.faults.wrap(channel)
                while len(self._channels) > MAX_KV_PEER_CHANNELS:
                    evicted.append(self._channels.popitem(last=False)[1])
            channel = self._channels[target]
        for old in evicted:
            _close(old)
        return channel

    # --- Decode -------------------------------------------------------------------------------
    def Decode(self, request, context):  # noqa: N802
        """Resume KV transferred here, or prefill here. A request that is malformed, or does not
        match the KV parked for its id, is INVALID_ARGUMENT and frees that KV: nothing stays held."""
        rid, prompt = request.request_id, list(request.prompt_token_ids)
        self._refuse_if_failing(context)
        started = time.perf_counter()
        try:
            _check_request_id(rid)
            sampling = sampling_from_proto(request.sampling)
            stream = self._resume(request, prompt, sampling)
            used_transfer = stream is not None
            if stream is None:
                self._refuse_if_draining(context)  # transferred KV is served; fresh work goes elsewhere
                stream = self.loop.submit(prompt, sampling, rid, detokenize=request.detokenize,
                                          cache_salt=request.cache_salt)
        except (InvalidRequestError, ValueError) as e:
            self.engine.handoff.drop(rid)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        _on_call_end(context, lambda: self.loop.abort(rid))
        yield from self._stream_replies(rid, stream, used_transfer, started, context)

    def _resume(self, request, prompt: list[int], sampling) -> RequestStream | None:
        if request.prefill_here or not request.HasField("first_token"):
            return None
        return self.loop.resume(request.request_id, prompt, request.first_token, sampling,
                                rng_state_from_bytes(request.rng_state), request.detokenize,
                                request.cache_salt)

    def _stream_replies(self, rid: str, stream: RequestStream, used_transfer: bool, started: float, context):
        first, finished, last_sent = True, False, started
        try:
            for out in stream:
                finished = out.finished
                if out.finish_reason == "error":
                    context.abort(grpc.StatusCode.INTERNAL, f"the engine failed while decoding {rid} "
                                  "(see the worker's log); the worker is still serving, retry the request")
                last_sent = self._observe_latency(first, started, last_sent)
                reply = worker_pb2.DecodeReply(token_ids=out.new_token_ids, text=out.text_delta,
                                               finished=out.finished, finish_reason=out.finish_reason or "")
                if first:
                    reply.used_transferred_kv = used_transfer
                    reply.prefill_ms = 0.0 if used_transfer else (time.perf_counter() - started) * 1e3
                    first = False
                if out.finished:
                    reply.usage.CopyFrom(usage_to_proto(out.usage))
                    self._count_finished(out.usage, out.usage.completion_tokens)
                yield reply
        finally:
            if not finished:
                self.loop.abort(rid)

    def _observe_latency(self, first: bool, started: float, last_sent: float) -> float:
        now = time.perf_counter()
        (self.metrics.ttft if first else self.metrics.itl).observe(now - (started if first else last_sent))
        return now

    def _refuse_if_draining(self, context) -> None:
        self._refuse_if_failing(context)
        if not self.serving:
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          f"worker {self.identity.worker_id} is draining and takes no new requests; "
                          "send it to another worker")

    def _refuse_if_failing(self, context) -> None:
        if self.failing is not None:
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          f"worker {self.identity.worker_id} is out of service: {self.failing}; "
                          "send it to another worker")

    # --- Abort / Status ---------------------------------------------------------------------------
    def Abort(self, request, context):  # noqa: N802
        return worker_pb2.AbortReply(found=self.loop.abort(request.request_id))

    def Status(self, request, context):  # noqa: N802
        return self.status()

    def status(self) -> worker_pb2.WorkerStatus:
        e, load = self.engine, self.engine.load()  # never waits behind an engine step
        status = worker_pb2.WorkerStatus(
            active_requests=load.running, waiting_requests=load.waiting, num_blocks=load.num_blocks,
            free_blocks=load.free_blocks, cached_blocks=load.cached_blocks, used_blocks=load.used_blocks,
            parked_transfers=load.parked_transfers, held_blocks=self.sender.pinned_blocks(),
            bytes_sent=self.bytes_sent, bytes_received=self.receiver.bytes_received,
            model_fingerprint=e.fingerprint, block_size=e.block_size)
        with self._lock:
            status.prompt_tokens_total, status.cached_tokens_total = self.totals.prompt, self.totals.cached
            status.generated_tokens_total = self.totals.generated
            status.preemptions_total = self.totals.preemptions
            status.send_outcomes.update(self.send_outcomes)
        status.transfer_outcomes.update(self.receiver.outcomes)
        audit = self.auditor.totals()
        status.kv_audited_blocks_total, status.kv_audit_mismatches_total = audit.checked, audit.mismatched
        status.kv_audit_evicted_total, status.kv_audit_seconds_total = audit.evicted, audit.seconds
        status.serving = self.serving and self.failing is None
        status.MergeFrom(self.identity)
        return status

    # --- Audit -----------------------------------------------------------------------------------
    def Audit(self, request, context):  # noqa: N802
        """KV audit of this worker's cache (engine/audit.py); it stops starting new recomputes at 90%
        of the call's deadline, and says so with complete=false."""
        remaining = context.time_remaining()  # NOTE: about 2**63 s when the caller set no deadline
        stop_at = time.monotonic() + 0.9 * remaining if remaining is not None and remaining < 1e9 else None
        report = self.auditor.audit(request.sample, stop_at)
        return _audit_reply(self.identity.worker_id, report)

    def close(self) -> None:
        with self._lock:
            for channel in self._channels.values():
                _close(channel)
            self._channels.clear()


def _audit_reply(worker_id: str, r: AuditReport) -> worker_pb2.AuditReply:
    return worker_pb2.AuditReply(
        worker_id=worker_id, cached_blocks=r.cached_blocks, checked=r.checked, exact=r.exact,
        mismatched=r.mismatched, evicted=r.evicted, evicted_in_use=r.evicted_in_use, skipped=r.skipped,
        rule=r.rule, elapsed_ms=r.elapsed_s * 1e3, max_abs_diff=r.max_abs_diff, max_rel_diff=r.max_rel_diff,
        complete=r.complete, recomputed_tokens=r.recomputed_tokens)


def _prefill_failure_code(kind: FailureKind) -> grpc.StatusCode:
    if kind in _RETRYABLE_AS_ABORTED:
        return grpc.StatusCode.ABORTED
    return getattr(grpc.StatusCode, kind.value, grpc.StatusCode.INTERNAL)


def _close(channel: KVChannel) -> None:
    close = getattr(channel, "close", None)  # the loopback transport holds nothing to close
    if close is not None:
        close()


def _on_call_end(context, callback) -> None:
    """Run callback when the call ends. NOTE: add_callback returns False, and never calls it,
    when the call has already ended (a client that cancelled at once): run it now instead."""
    if not context.add_callback(callback):
        callback()


def _check_request_id(request_id: str) -> None:
    if not request_id:
        raise InvalidRequestError("request_id is empty: give each request an id")


def _sampling_or_abort(proto, context):
    try:
        return sampling_from_proto(proto)
    except ValueError as e:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

