"""The Worker gRPC service: Prefill, Decode, Abort, Status over one engine loop.

Prefill (remote prefill for a decode target):
    register the outgoing transfer -> submit(max_tokens=1, hold_blocks) -> layers stream
    out as they are computed -> first token sampled -> END -> wait for the receiver's reply
    -> release the held blocks (they stay in this worker's prefix cache).
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
from dataclasses import dataclass, replace

import grpc

from pdserve.engine.audit import AuditReport, KVAuditor
from pdserve.engine.llm_engine import InvalidRequestError, LLMEngine
from pdserve.security import SecurityConfig
from pdserve.transfer.errors import FailureKind, TransferFailed
from pdserve.transfer.faults import FaultInjectingChannel, FaultInjector
from pdserve.transfer.grpc_transport import GrpcKVChannel
from pdserve.transfer.receiver import KVReceiver
from pdserve.transfer.sender import LayerwiseSender
from pdserve.worker.convert import (
    rng_state_from_bytes,
    rng_state_to_bytes,
    sampling_from_proto,
    usage_to_proto,
)
from pdserve.worker.engine_loop import EngineLoop, RequestStream
from pdserve.worker.metrics import TRANSFER_OK, WorkerMetrics
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
                 security: SecurityConfig | None = None, auditor: KVAuditor | None = None) -> None:
        self.engine, self.loop, self.sender, self.receiver = engine, loop, sender, receiver
        self.auditor = auditor or KVAuditor(engine)
        self.transfer_timeout_s = transfer_timeout_s  # None: the Prefill call's remaining time
        self.faults = faults  # None (the default): channels are not wrapped at all
        self.security = security  # how KV channels dial decode workers; None: plaintext
        self.identity = identity
        self.metrics = metrics or WorkerMetrics()
        self.serving = True
        self.bytes_sent = 0
        self.totals = TokenTotals()
        self.send_outcomes: Counter[str] = Counter()
        # NOTE: one channel per decode worker address, least recently used first. A decode worker
        # that restarts comes back on a new port, so without a bound this grows by one channel
        # per restart for the life of the process.
        self._channels: OrderedDict[str, GrpcKVChannel | FaultInjectingChannel] = OrderedDict()
        self._lock = threading.Lock()

    # --- Prefill ----------------------------------------------------------------------------
    def Prefill(self, request, context):  # noqa: N802
        self._refuse_if_draining(context)
        rid, prompt = request.request_id, list(request.prompt_token_ids)
        sampling = _sampling_or_abort(request.sampling, context)
        timeout = context.time_remaining() or DEFAULT_TIMEOUT_S
        if self.transfer_timeout_s is not None:
            timeout = min(timeout, self.transfer_timeout_s)
        started = time.perf_counter()
        transfer = self.sender.start(rid, prompt, request.target_cached_blocks,
                                     self._channel(request.decode_target), timeout)
        try:
            stream = self.loop.submit(prompt, replace(sampling, max_tokens=1, stop=()), rid,
                                      detokenize=False, hold_blocks=True)
        except (InvalidRequestError, ValueError) as e:
            transfer.abort()
            self.sender.finish(rid)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        _on_call_end(context, lambda: (transfer.abort(), self.loop.abort(rid)))
        try:
            return self._finish_prefill(rid, stream, transfer, started, context)
        finally:
            self.sender.finish(rid)
            self.engine.release_held(rid)

    def _finish_prefill(self, rid, stream: RequestStream, transfer, started: float, context):
        last = next(o for o in stream if o.finished)
        if last.finish_reason in ("abort", "error"):
            transfer.abort()
            if last.finish_reason == "error":
                context.abort(grpc.StatusCode.INTERNAL, f"the engine failed while prefilling {rid} (see the "
                              "worker's log); the router prefills it elsewhere")
            context.abort(grpc.StatusCode.CANCELLED, f"request {rid} was aborted during prefill")
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

    def _count_send(self, outcome: str) -> None:
        with self._lock:
            self.send_outcomes[outcome] += 1

    def _count_finished(self, usage, generated: int) -> None:
        with self._lock:
            self.totals.prompt += usage.prompt_tokens
            self.totals.cached += usage.cached_tokens
            self.totals.generated += generated
            self.totals.preemptions += usage.preemptions

    def _channel(self, target: str) -> GrpcKVChannel | FaultInjectingChannel:
        """The KV channel to target; past MAX_KV_PEER_CHANNELS peers the least recently used is
        closed (its peer is most likely a decode worker that restarted on another port)."""
        evicted = []
        with self._lock:
            if target in self._channels:
                self._channels.move_to_end(target)
            else:
                channel = GrpcKVChannel(target, self.security)
                self._channels[target] = channel if self.faults is None else self.faults.wrap(channel)
                while len(self._channels) > MAX_KV_PEER_CHANNELS:
                    evicted.append(self._channels.popitem(last=False)[1])
            channel = self._channels[target]
        for old in evicted:
            old.close()
        return channel

    # --- Decode -------------------------------------------------------------------------------
    def Decode(self, request, context):  # noqa: N802
        rid, prompt = request.request_id, list(request.prompt_token_ids)
        sampling = _sampling_or_abort(request.sampling, context)
        started = time.perf_counter()
        stream = None
        if not request.prefill_here and request.HasField("first_token"):
            stream = self.loop.resume(rid, request.first_token, sampling,
                                      rng_state_from_bytes(request.rng_state), request.detokenize)
        used_transfer = stream is not None
        if stream is None:
            self._refuse_if_draining(context)  # transferred KV is served; fresh work goes elsewhere
            try:
                stream = self.loop.submit(prompt, sampling, rid, detokenize=request.detokenize)
            except (InvalidRequestError, ValueError) as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        _on_call_end(context, lambda: self.loop.abort(rid))
        yield from self._stream_replies(rid, stream, used_transfer, started, context)

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
        if not self.serving:
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          f"worker {self.identity.worker_id} is draining and takes no new requests; "
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
            parked_transfers=load.parked_transfers, held_blocks=load.held_blocks,
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
        status.serving = self.serving
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
                channel.close()
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


def _on_call_end(context, callback) -> None:
    """Run callback when the call ends. NOTE: add_callback returns False, and never calls it,
    when the call has already ended (a client that cancelled at once): run it now instead."""
    if not context.add_callback(callback):
        callback()


def _sampling_or_abort(proto, context):
    try:
        return sampling_from_proto(proto)
    except ValueError as e:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

