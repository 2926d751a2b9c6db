"""The DecodeService: continue a prompt whose KV was transferred here, or prefill it here, and
stream its tokens.

    Decode: resume the parked KV with the prefill worker's first token and its logprob (every
      field is checked against what was parked: a mismatch is INVALID_ARGUMENT and frees it), or
      prefill here when told to or when no KV arrived (a failed transfer: recompute, so the output
      stays exact) -> stream DecodeReply messages (with the logprobs asked for), the last with usage

A cancelled or expired call aborts the request: its blocks are freed at once. A draining worker
still serves KV already transferred here; fresh work goes elsewhere (UNAVAILABLE).
"""

from __future__ import annotations

import time

import grpc

from pdserve.engine.llm_engine import InvalidRequestError
from pdserve.engine.sequence import SamplingParams
from pdserve.worker.convert import (
    logprob_from_proto,
    logprobs_to_proto,
    rng_state_from_bytes,
    sampling_from_proto,
    usage_to_proto,
)
from pdserve.worker.engine_loop import RequestStream
from pdserve.worker.service import WorkerParts, check_request_id, on_call_end
from protos.pdserve.v1 import worker_pb2, worker_pb2_grpc


class DecodeServicer(worker_pb2_grpc.DecodeServiceServicer):
    def __init__(self, parts: WorkerParts) -> None:
        self.parts = parts

    def Decode(self, request, context):  # noqa: N802
        """Resume KV transferred here, or prefill here. A request that is malformed, or does not
        match the KV parked for its id, is INVALID_ARGUMENT and frees that KV: nothing stays held."""
        rid, prompt, loop = request.request_id, list(request.prompt_token_ids), self.parts.loop
        self.parts.state.refuse_if_failing(context)
        started = time.perf_counter()
        try:
            check_request_id(rid)
            sampling = sampling_from_proto(request.sampling)
            stream = self._resume(request, prompt, sampling)
            used_transfer = stream is not None
            if stream is None:
                self.parts.state.refuse_if_draining(context)
                stream = loop.submit(prompt, sampling, rid, detokenize=request.detokenize,
                                     cache_salt=request.cache_salt)
        except (InvalidRequestError, ValueError) as e:
            self.parts.engine.handoff.drop(rid)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        on_call_end(context, lambda: loop.abort(rid))
        yield from self._stream_replies(rid, stream, used_transfer, started, context)

    def _resume(self, request, prompt: list[int], sampling: SamplingParams) -> RequestStream | None:
        if request.prefill_here or not request.HasField("first_token"):
            return None
        given = request.HasField("first_logprob")
        first_logprob = logprob_from_proto(request.first_logprob) if given else None
        return self.parts.loop.resume(request.request_id, prompt, request.first_token, sampling,
                                      rng_state_from_bytes(request.rng_state), request.detokenize,
                                      request.cache_salt, first_logprob)

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
                                               finished=out.finished, finish_reason=out.finish_reason or "",
                                               logprobs=logprobs_to_proto(out.logprobs))
                if first:
                    reply.used_transferred_kv = used_transfer
                    reply.prefill_ms = 0.0 if used_transfer else (time.perf_counter() - started) * 1e3
                    first = False
                if out.finished:
                    reply.usage.CopyFrom(usage_to_proto(out.usage))
                    self.parts.totals.count(out.usage, out.usage.completion_tokens)
                yield reply
        finally:
            if not finished:
                self.parts.loop.abort(rid)

    def _observe_latency(self, first: bool, started: float, last_sent: float) -> float:
        now = time.perf_counter()
        metrics = self.parts.metrics
        (metrics.ttft if first else metrics.itl).observe(now - (started if first else last_sent))
        return now
