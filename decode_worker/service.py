"""The DecodeService: continue a prompt whose KV was transferred here, or prefill it here, and
stream its tokens.

    Decode: resume the parked KV with the prefill worker's first token and its logprob (every
      field is checked against what was parked: a mismatch is INVALID_ARGUMENT and frees it), or
      prefill here when told to or when no KV arrived (a failed transfer: recompute, so the output
      stays exact) -> stream DecodeReply messages (with the logprobs asked for), the first and the
      last with usage
    A migrated stream (generated_token_ids set: router/service.py) goes on after the tokens its
      earlier workers generated: the engine replays them with the prompt (its prefix cache may
      hold them) and counts them as output, so the tokens and text that follow are the ones the
      interrupted worker would have sent.

A cancelled or expired call aborts the request: its blocks are freed at once. A draining worker
still serves KV already transferred here; fresh work goes elsewhere (UNAVAILABLE).
"""

from __future__ import annotations

import time

import grpc

from decode_worker.faults import NO_HOLD
from pdserve.engine.llm_engine import InvalidRequestError
from pdserve.engine.sequence import SamplingParams
from pdserve.worker.convert import (
    logprob_from_proto,
    logprobs_to_proto,
    sampling_from_proto,
    usage_to_proto,
)
from pdserve.worker.engine_loop import RequestStream
from pdserve.worker.service import WorkerParts, check_request_id, on_call_end
from protos.pdserve.v1 import worker_pb2, worker_pb2_grpc


class DecodeServicer(worker_pb2_grpc.DecodeServiceServicer):
    def __init__(self, parts: WorkerParts, hold=NO_HOLD) -> None:
        self.parts = parts
        self.hold = hold  # a debug fault plan's stream hold (faults.py); NO_HOLD never waits

    def Decode(self, request, context):  # noqa: N802
        """Resume KV transferred here, or prefill here. A request that is malformed, or does not
        match the KV parked for its id, is INVALID_ARGUMENT and frees that KV: nothing stays held."""
        rid, prompt, loop = request.request_id, list(request.prompt_token_ids), self.parts.loop
        generated = tuple(request.generated_token_ids)
        self.parts.state.refuse_if_failing(context)
        started = time.perf_counter()
        try:
            check_request_id(rid)
            sampling = sampling_from_proto(request.sampling)
            stream = self._resume(request, prompt, sampling, generated)
            used_transfer = stream is not None
            if stream is None:
                self.parts.state.refuse_if_draining(context)
                stream = loop.submit(prompt, sampling, rid, detokenize=request.detokenize,
                                     cache_salt=request.cache_salt, generated=generated)
        except (InvalidRequestError, ValueError) as e:
            self.parts.engine.handoff.drop(rid)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        on_call_end(context, lambda: loop.abort_later(rid))
        yield from self._stream_replies(rid, stream, used_transfer, started, len(generated), context)

    def _resume(self, request, prompt: list[int], sampling: SamplingParams,
                generated: tuple[int, ...]) -> RequestStream | None:
        if request.prefill_here or not request.HasField("first_token"):
            return None
        given = request.HasField("first_logprob")
        first_logprob = logprob_from_proto(request.first_logprob) if given else None
        return self.parts.loop.resume(request.request_id, prompt, request.first_token, sampling,
                                      request.detokenize, request.cache_salt, first_logprob, generated)

    def _stream_replies(self, rid: str, stream: RequestStream, used_transfer: bool, started: float,
                        continued: int, context):
        first, finished, last_sent, sent = True, False, started, 0
        try:
            for out in stream:
                self.hold.before_reply(rid, sent, context)
                finished = out.finished
                if out.finish_reason == "error":
                    context.abort(grpc.StatusCode.INTERNAL, f"the engine failed while decoding {rid} "
                                  "(see the worker's log); the worker is still serving, retry the request")
                last_sent = self._observe_latency(first, started, last_sent)
                reply = worker_pb2.DecodeReply(token_ids=out.new_token_ids, text=out.text_delta,
                                               finished=out.finished, finish_reason=out.finish_reason or "",
                                               logprobs=logprobs_to_proto(out.logprobs))
                if first or out.finished:
                    reply.usage.CopyFrom(usage_to_proto(out.usage))
                if first:
                    reply.used_transferred_kv = used_transfer
                    reply.prefill_ms = 0.0 if used_transfer else (time.perf_counter() - started) * 1e3
                    first = False
                if out.finished:  # (a continued request's earlier tokens were counted where they were made)
                    self.parts.totals.count(out.usage, out.usage.completion_tokens - continued)
                sent += len(out.new_token_ids)
                yield reply
        finally:
            if not finished:
                self.parts.loop.abort(rid)

    def _observe_latency(self, first: bool, started: float, last_sent: float) -> float:
        now = time.perf_counter()
        metrics = self.parts.metrics
        (metrics.ttft if first else metrics.itl).observe(now - (started if first else last_sent))
        return now
