"""The PrefillService: compute a prompt here and stream its KV to the decode worker that will
decode it. The one prefill orchestration: production and the transfer tests
(tests/helpers/rig.py) both run it.

    Prefill: check the decode target (a live decode worker in the registry: peers.py)
      -> register the outgoing transfer -> submit(max_tokens=1) -> each layer's blocks are pinned
      and stream out as they are computed (sender.py) -> first token sampled (with its logprob,
      when asked: only this engine sees its logits) -> END -> wait for the receiver's reply
      -> unpin the blocks (they stay in this worker's prefix cache)

The call ending early (cancelled, past its deadline) aborts the transfer first, then the
request; a preempted request aborts its transfer. Either way no END is sent after the abort,
so the decode worker discards everything it received. A failed transfer fails the call with
the transfer's FailureKind as its status code, except that CANCELLED and DEADLINE_EXCEEDED
become ABORTED: those two codes would say that the Prefill call itself was cancelled or ran out
of time, and callers do not retry those.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import replace

import grpc

from pdserve.engine.llm_engine import InvalidRequestError
from pdserve.transfer.errors import FailureKind, TransferFailed
from pdserve.worker.convert import logprob_to_proto, usage_to_proto
from pdserve.worker.engine_loop import RequestStream
from pdserve.worker.metrics import TRANSFER_OK
from pdserve.worker.service import WorkerParts, on_call_end, sampling_or_abort
from prefill_worker.channels import DecodeChannels
from prefill_worker.peers import DecodeTargets
from prefill_worker.sender import LayerwiseSender, OutgoingTransfer
from protos.pdserve.v1 import worker_pb2, worker_pb2_grpc

DEFAULT_TIMEOUT_S = 60.0  # a push's deadline when the Prefill call has none
_RETRYABLE_AS_ABORTED = {FailureKind.CANCELLED, FailureKind.DEADLINE_EXCEEDED}


class PrefillServicer(worker_pb2_grpc.PrefillServiceServicer):
    def __init__(self, parts: WorkerParts, sender: LayerwiseSender, channels: DecodeChannels,
                 decode_targets: DecodeTargets, transfer_timeout_s: float | None = None) -> None:
        self.parts, self.sender, self.channels = parts, sender, channels
        self.decode_targets = decode_targets  # where Prefill may push KV
        self.transfer_timeout_s = transfer_timeout_s  # None: the Prefill call's remaining time
        self.bytes_sent = 0
        self.send_outcomes: Counter[str] = Counter()
        self._lock = threading.Lock()

    def Prefill(self, request, context):  # noqa: N802
        self.parts.state.refuse_if_draining(context)
        rid, prompt = request.request_id, list(request.prompt_token_ids)
        sampling = sampling_or_abort(request.sampling, context)
        if not rid:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty: give each request an id")
        if not self.decode_targets.allows(request.decode_target):
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          f"decode_target {request.decode_target!r} is not a live decode worker in the "
                          "registry; this worker pushes KV only to registered decode workers")
        started = time.perf_counter()
        transfer = self.sender.start(rid, prompt, request.decode_cached_blocks,
                                     self.channels(request.decode_target), self._push_timeout(context),
                                     cache_salt=request.cache_salt)
        try:
            try:
                stream = self.parts.loop.submit(prompt, replace(sampling, max_tokens=1, stop=()), rid,
                                                detokenize=False, cache_salt=request.cache_salt)
            except (InvalidRequestError, ValueError) as e:
                transfer.abort(FailureKind.INVALID_ARGUMENT, str(e))
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            on_call_end(context, lambda: self._cancel(transfer, rid))
            return self._finish(rid, stream, transfer, started, context)
        finally:
            self.sender.finish(rid)

    def _push_timeout(self, context) -> float:
        timeout = context.time_remaining() or DEFAULT_TIMEOUT_S
        return timeout if self.transfer_timeout_s is None else min(timeout, self.transfer_timeout_s)

    def _cancel(self, transfer: OutgoingTransfer, rid: str) -> None:
        """The Prefill call ended (cancelled, past its deadline, or answered). NOTE: this runs on
        gRPC's event thread, so nothing here waits for the step in flight: the transfer is stopped
        now (first, so that no block is let go of while the sender could still send END after it),
        and the loop drops the request and lets go of the transfer's blocks at its next turn."""
        transfer.stop(FailureKind.CANCELLED, "the Prefill call ended (cancelled, or past its deadline)")
        self.parts.loop.abort_later(rid, after_drop=transfer.release)

    def _finish(self, rid: str, stream: RequestStream, transfer: OutgoingTransfer, started: float, context):
        last = next(o for o in stream if o.finished)
        if last.finish_reason in ("abort", "error"):
            self._end_early(rid, last.finish_reason, transfer, context)
        computed = time.perf_counter()
        transfer.close()
        self.parts.metrics.ttft.observe(computed - started)
        try:
            push = transfer.wait()
        except TransferFailed as e:
            self._count_send(e.kind.value)
            context.abort(_failure_code(e.kind),
                          f"KV transfer to the decode worker failed ({e.kind.value}): {e.message}")
        self._count_send(TRANSFER_OK, push.bytes_sent)
        self.parts.totals.count(last.usage, generated=0)
        reply = worker_pb2.PrefillReply(
            first_token=last.new_token_ids[0], usage=usage_to_proto(last.usage), bytes_sent=push.bytes_sent,
            blocks_sent=push.blocks_written,
            prefill_ms=(computed - started) * 1e3, transfer_ms=(time.perf_counter() - computed) * 1e3)
        if last.logprobs:
            reply.first_logprob.CopyFrom(logprob_to_proto(last.logprobs[0]))
        return reply

    def _end_early(self, rid: str, finish_reason: str, transfer: OutgoingTransfer, context) -> None:
        """The request ended without its first token: aborted (the call ended, or preempted) or
        failed in the engine. Its transfer is aborted; the call fails with why."""
        if finish_reason == "error":
            self._count_send(transfer.abort(FailureKind.INTERNAL, "the engine failed").kind.value)
            context.abort(grpc.StatusCode.INTERNAL, f"the engine failed while prefilling {rid} (see the "
                          "worker's log); the router prefills it elsewhere")
        failure = transfer.abort(FailureKind.CANCELLED, f"request {rid} was aborted during prefill")
        self._count_send(failure.kind.value)
        context.abort(_failure_code(failure.kind),
                      f"KV transfer to the decode worker did not complete ({failure.kind.value}): "
                      f"{failure.message}")

    def _count_send(self, outcome: str, nbytes: int = 0) -> None:
        with self._lock:
            self.send_outcomes[outcome] += 1
            self.bytes_sent += nbytes

    def fill_status(self, status: worker_pb2.WorkerStatus) -> None:
        status.held_blocks = self.sender.pinned_blocks()
        with self._lock:
            status.bytes_sent = self.bytes_sent
            status.send_outcomes.update(self.send_outcomes)


def _failure_code(kind: FailureKind) -> grpc.StatusCode:
    if kind in _RETRYABLE_AS_ABORTED:
        return grpc.StatusCode.ABORTED
    return getattr(grpc.StatusCode, kind.value, grpc.StatusCode.INTERNAL)
