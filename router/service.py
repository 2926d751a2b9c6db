"""The public Generation service: tokenize -> place -> (remote prefill) -> decode -> stream.

Lifecycle of a request at the router (_Phase; how it ended is its gRPC code, OK or another):
    received -> placed -> prefilling (on a prefill worker, KV streaming to the decode worker)
             -> decoding (tokens streaming back) -> ended (a request that ends other than OK is
                counted with the phase it stood in: pdserve_router_ended_early_total{code,phase})
    decoding --the decode worker breaks the stream--> broken, then
        nothing sent yet, and it was down, draining or full (RETRY_ON_ANOTHER_DECODE) -> placed again
        tokens sent, and it was gone or failed (MIGRATE_ON) -> migrating -> placed again, with
            prompt + every token sent so far as the prompt (the new worker reuses what its prefix
            cache holds of it, or recomputes it), the same sampling and seed, and the tokens so
            far as generated_token_ids: its engine counts them as output (max_tokens, stop
            strings, text), and draws by (seed, position), so the client sees one unbroken
            stream, token for token the one an uninterrupted run sends. At most
            MigrationPolicy.limit moves (--migration-limit); each is counted by cause
            (pdserve_router_migrations_total) and listed in the last message (migrations).
        anything else -> aborted with the worker's status
    Every worker a request broke on is excluded from its later placements.
A request that sets no seed gets one here, so that every stream can be continued exactly.
A failed remote prefill (worker down, transfer failed, or either stalled past the prefill
phase's own deadline: router/config.py RequestDeadlines) falls back to prefill on the decode
worker, so the output stays exact; bad input is INVALID_ARGUMENT before any worker is
touched; a cancelled or expired client call cancels the downstream calls, which free the
request's blocks on both workers. Before it is received, a call over max_concurrent_streams is
refused at once (RESOURCE_EXHAUSTED, retry-after-ms trailer); it is never queued. The
request limits and their checks are in router/limits.py. Under cache isolation "token"
(--cache-isolation) each API token's requests are hashed with their own cache salt.

Workers see the request under its own id (the client's request_id plus a random suffix), so
two clients that pick the same request_id never collide on a worker; replies carry the
client's id.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from pdserve.engine.sampling_defaults import NEUTRAL, SamplingDefaults
from pdserve.engine.tokenizer import Tokenizer
from pdserve.roles import CHAT_ROLES
from pdserve.security.auth import bearer_token, tenant_cache_salt
from pdserve.worker.convert import sampling_from_proto, sampling_with_defaults
from protos.pdserve.v1 import generation_pb2, generation_pb2_grpc, worker_pb2
from router import limits as lim
from router.config import MigrationPolicy, RequestDeadlines
from router.least_load import NoWorkerError
from router.limits import RequestLimits, StreamLimitReached
from router.metrics import RouterMetrics
from router.placement import AdmissionRefused, Placement, Placer
from router.prediction import PredictionTracker
from router.workers import WorkerDirectory

log = logging.getLogger(__name__)

# A remote prefill that fails with one of these is the request's own fault: the decode worker
# would refuse it too. Anything else (the prefill worker down, its transfer failed or stalled past
# the prefill phase's deadline) falls back to prefill on the decode worker while the client waits.
NOT_FALLBACK = {grpc.StatusCode.INVALID_ARGUMENT}
# A decode worker that answers these before the first token did nothing for the request: it is dead or
# draining (UNAVAILABLE), or full (RESOURCE_EXHAUSTED: its own call limit); another may start afresh.
RETRY_ON_ANOTHER_DECODE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}
# A stream that breaks with these after tokens reached the client lost its worker, not its request:
# UNAVAILABLE (the connection broke: the process died; it drained past its grace; it is out of
# service), CANCELLED while the client's own call is live (the worker's server stopped and cancelled
# it), INTERNAL (its engine failed a step; the worker says so and keeps serving), RESOURCE_EXHAUSTED
# (the worker it was moving to is full). It moves on. INVALID_ARGUMENT, DEADLINE_EXCEEDED and the
# rest are the request's own: another worker would answer the same.
MIGRATE_ON = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL,
              grpc.StatusCode.RESOURCE_EXHAUSTED}


class _Phase(enum.Enum):
    """Where a request stands at the router (the lifecycle in the module docstring)."""

    RECEIVED = "received"
    PLACED = "placed"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    MIGRATING = "migrating"


def random_seed() -> int:
    """A seed for a request that gave none (any uint64)."""
    return int.from_bytes(os.urandom(8), "little")


@dataclass(frozen=True)
class _Job:
    """What every worker call of one request carries."""

    rid: str  # the client's request id (replies carry it)
    worker_rid: str  # the id workers see: rid plus a suffix of ours
    prompt: list[int]
    sampling: generation_pb2.SamplingParams
    cache_salt: bytes  # the tenant's prefix-cache salt under --cache-isolation token, else b""


@dataclass
class _Trace:
    """Per-request timing and accounting, filled as the request moves; what a migration carries."""

    received: float = field(default_factory=time.perf_counter)
    phase: _Phase = _Phase.RECEIVED
    prefill_started: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    prefill_ms: float = 0.0
    transfer_ms: float = 0.0
    prompt_usage: generation_pb2.Usage | None = None  # the prompt's cached/computed where first served
    usage: generation_pb2.Usage | None = None  # the final one, as sent to the client
    code: str | None = None  # gRPC status name once decided; None while running
    generated: list[int] = field(default_factory=list)  # every token sent to the client
    migrations: list[generation_pb2.Migration] = field(default_factory=list)
    moving: generation_pb2.Migration | None = None  # the migration whose first token is still to come


@dataclass(frozen=True)
class _Break:
    """How a decode stream ended early: the status it broke with."""

    code: grpc.StatusCode
    details: str


class InvalidPrompt(ValueError):
    pass


class _ClientGone(Exception):
    """The client's call ended (cancelled, or past its deadline) while we waited on a worker."""


def prompt_token_ids(request: generation_pb2.GenerateRequest, tokenizer: Tokenizer,
                     limits: RequestLimits | None = None) -> list[int]:
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise InvalidPrompt("prompt is missing: set one of text, chat or token_ids")
    if kind == "token_ids":
        ids = list(request.token_ids.ids)
    elif kind == "chat":
        lim.check_chat(len(request.chat.messages), limits or RequestLimits())
        ids = tokenizer.apply_chat_template(_chat_messages(request.chat), add_generation_prompt=True,
                                            **_template_kwargs(request.chat))
    elif request.raw:  # as the model's own tokenizer (and vLLM's completions) do: its <bos>, if any
        ids = tokenizer.encode(request.text, add_special_tokens=True)
    else:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": request.text}],
                                            add_generation_prompt=True)
    if not ids:
        raise InvalidPrompt("prompt is empty: give at least 1 token")
    bad = next((t for t in ids if t >= tokenizer.vocab_size), None)
    if bad is not None:
        raise InvalidPrompt(f"prompt token id {bad} is outside the vocabulary [0, {tokenizer.vocab_size})")
    return ids


# Set by the renderer from the request itself (pdserve/engine/tokenizer.py render_chat), so not a
# variable chat_template_kwargs may give.
_RENDERER_VARIABLES = ("messages", "tools", "documents", "add_generation_prompt")


def _template_kwargs(chat: generation_pb2.ChatMessages) -> dict[str, Any]:
    """chat.chat_template_kwargs: a JSON object of extra chat-template variables ("" = none)."""
    if not chat.chat_template_kwargs:
        return {}
    try:
        kwargs = json.loads(chat.chat_template_kwargs)
    except json.JSONDecodeError as e:
        raise InvalidPrompt(f"chat_template_kwargs is not valid JSON: {e}") from None
    if not isinstance(kwargs, dict):
        raise InvalidPrompt(f"chat_template_kwargs must be a JSON object, got {type(kwargs).__name__}")
    taken = sorted(set(kwargs) & set(_RENDERER_VARIABLES))
    if taken:
        raise InvalidPrompt(f"chat_template_kwargs.{taken[0]}: pdserve sets it from the request itself")
    return kwargs


def _chat_messages(chat: generation_pb2.ChatMessages) -> list[dict[str, str]]:
    if not chat.messages:
        raise InvalidPrompt("chat.messages is empty: give at least one message")
    for i, m in enumerate(chat.messages):
        if m.role not in CHAT_ROLES:
            raise InvalidPrompt(f"chat.messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, "
                                f"got {m.role!r}")
    return [{"role": m.role, "content": m.content} for m in chat.messages]


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, tokenizer: Tokenizer, directory: WorkerDirectory, placer: Placer,
                 deadlines: RequestDeadlines, metrics: RouterMetrics | None = None,
                 limits: RequestLimits | None = None, cache_isolation: str = "none",
                 sampling_defaults: SamplingDefaults = NEUTRAL, migration: MigrationPolicy | None = None,
                 pick_seed: Callable[[], int] = random_seed) -> None:
        self.tokenizer, self.directory, self.placer, self.deadlines = tokenizer, directory, placer, deadlines
        self.metrics = metrics or RouterMetrics()
        self.limits = limits or RequestLimits()
        self.cache_isolation = cache_isolation
        self.sampling_defaults = sampling_defaults  # what a request's unset temperature/top_p/top_k become
        self.migration = migration or MigrationPolicy()
        self.pick_seed = pick_seed  # the seed of a request that sets none
        self.requests_in_flight = 0
        self.predictions = PredictionTracker()
        self._lock = threading.Lock()

    def Generate(self, request, context):  # noqa: N802
        trace = _Trace()
        refused = self._enter()
        try:
            if refused is not None:
                self._refuse(trace, context, str(refused), refused.retry_after_s)
            yield from self._generate(request, trace, context)
        except _ClientGone:
            pass  # the call is already over; _record names it CANCELLED or DEADLINE_EXCEEDED
        finally:
            if refused is None:
                self._leave()
            self._record(trace, context)

    def _enter(self) -> StreamLimitReached | None:
        """Count one more stream in flight, or return the refusal when the limit is reached."""
        with self._lock:
            try:
                lim.check_streams(self.requests_in_flight, self.limits)
            except StreamLimitReached as e:
                return e
            self.requests_in_flight += 1
        self.metrics.in_flight.inc()
        return None

    def _leave(self) -> None:
        with self._lock:
            self.requests_in_flight -= 1
        self.metrics.in_flight.dec()

    def _generate(self, request, trace: _Trace, context):
        prompt, sampling = self._validated(request, trace, context)
        rid = request.request_id or uuid.uuid4().hex
        worker_rid = f"{rid}.{uuid.uuid4().hex[:12]}" if request.request_id else rid
        job = _Job(rid, worker_rid, prompt, sampling, self._cache_salt(context))
        trace.generated = self._continuation(request, sampling, trace, context)
        failed: set[str] = set()  # decode workers this request broke on: not placed on again
        while True:
            placement = self._place(job, request, trace, context, exclude=failed)
            with self.directory.track(placement.decode, placement.prefill):
                prefill = self._remote_prefill(job, placement, trace, context)
                broke = yield from self._decode(job, placement, prefill, trace, context)
            if broke is None:
                return
            failed.add(placement.decode.worker_id)
            self._after_break(job, placement, broke, trace, context)

    def _after_break(self, job: _Job, placement: Placement, broke: _Break, trace: _Trace, context) -> None:
        """A decode stream broke and the client is still there: return to place the request again
        (a retry before anything was sent, or a migration), or end it with the worker's status."""
        worker = placement.decode.worker_id
        if not trace.generated and broke.code in RETRY_ON_ANOTHER_DECODE:
            log.warning("request %s: decode worker %s refused it before the first token (%s: %s); "
                        "retrying on another", job.rid, worker, broke.code.name, broke.details)
            self.metrics.decode_retries.inc()
            return
        if not trace.generated or broke.code not in MIGRATE_ON:
            self._abort(trace, context, broke.code, broke.details or broke.code.name)
        if len(trace.migrations) >= self.migration.limit:
            self._abort(trace, context, broke.code,
                        f"decode worker {worker} broke the stream after {len(trace.generated)} tokens "
                        f"({broke.code.name}: {broke.details}); it has moved {len(trace.migrations)} times, "
                        f"the router's migration limit (--migration-limit {self.migration.limit})")
        log.warning("request %s: decode worker %s broke the stream after %d tokens (%s: %s); continuing it "
                    "on another", job.rid, worker, len(trace.generated), broke.code.name, broke.details)
        self.metrics.migrations.labels(cause=broke.code.name).inc()
        trace.moving = generation_pb2.Migration(cause=broke.code.name, from_decode_worker=worker,
                                                after_tokens=len(trace.generated))
        trace.migrations.append(trace.moving)
        trace.phase = _Phase.MIGRATING

    @staticmethod
    def _abort(trace: _Trace, context, code: grpc.StatusCode, message: str):
        trace.code = code.name
        context.abort(code, message)

    def _refuse(self, trace: _Trace, context, message: str, retry_after_s: float):
        """RESOURCE_EXHAUSTED now, with the retry hint also as a retry-after-ms trailer."""
        context.set_trailing_metadata((("retry-after-ms", str(int(retry_after_s * 1000))),))
        self._abort(trace, context, grpc.StatusCode.RESOURCE_EXHAUSTED, message)

    def _record(self, trace: _Trace, context) -> None:
        if trace.code is None:  # the client went away mid-stream
            remaining = context.time_remaining()
            trace.code = "DEADLINE_EXCEEDED" if remaining is not None and remaining <= 0 else "CANCELLED"
        usage = trace.usage or generation_pb2.Usage()
        self.metrics.finished(trace.code, usage.prompt_tokens, usage.cached_tokens,
                              time.perf_counter() - trace.received, trace.phase.value)

    def _validated(self, request, trace: _Trace, context):
        """(prompt ids, the sampling proto to send: max_tokens, temperature, top_p and top_k always set,
        the last three from the served model's defaults where the request left them unset), or
        INVALID_ARGUMENT."""
        limits, context_tokens = self.limits, self.limits.max_context_tokens
        sampling = sampling_with_defaults(request.sampling, self.sampling_defaults)
        try:
            lim.check_request_id(request.request_id, limits)
            lim.check_sampling(sampling_from_proto(sampling), self.tokenizer.vocab_size, limits)
            prompt = prompt_token_ids(request, self.tokenizer, limits)
            lim.check_prompt(len(prompt), context_tokens, limits)
            asked = request.sampling.max_tokens if request.sampling.HasField("max_tokens") else None
            max_tokens = lim.resolve_max_tokens(asked, len(prompt), context_tokens, limits)
        except ValueError as e:
            self._abort(trace, context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        sampling.max_tokens = max_tokens
        if not sampling.HasField("seed"):  # NOTE: so that a migrated stream draws what this one would have
            sampling.seed = self.pick_seed()
        return prompt, sampling

    def _continuation(self, request, sampling: generation_pb2.SamplingParams, trace: _Trace,
                      context) -> list[int]:
        """The tokens a resumed request already streamed (client-side resume), checked: in the
        vocabulary, and fewer than max_tokens. Empty for a fresh request."""
        ids = list(request.continuation.ids)
        bad = next((t for t in ids if t >= self.tokenizer.vocab_size), None)
        if bad is not None:
            self._abort(trace, context, grpc.StatusCode.INVALID_ARGUMENT,
                        f"continuation token id {bad} is outside the vocabulary "
                        f"[0, {self.tokenizer.vocab_size})")
        if ids and len(ids) >= sampling.max_tokens:
            self._abort(trace, context, grpc.StatusCode.INVALID_ARGUMENT,
                        f"continuation has {len(ids):,} tokens and max_tokens is {sampling.max_tokens:,}: "
                        "nothing is left to generate")
        return ids

    def _cache_salt(self, context) -> bytes:
        """Under --cache-isolation token, the caller's tenant salt: its blocks match only its own."""
        if self.cache_isolation == "none":
            return b""
        token = bearer_token(context.invocation_metadata())
        if token is None:  # the router's token gate lets no such call through; refuse to mix caches
            raise RuntimeError("cache isolation by token is on but the call carries no bearer token")
        return tenant_cache_salt(token)

    def _place(self, job: _Job, request, trace: _Trace, context, exclude=frozenset()) -> Placement:
        """Where to serve prompt + the tokens sent so far (a migration replays them)."""
        replay = [*job.prompt, *trace.generated]
        try:
            with self.metrics.decision.time():
                placement = self.placer.place(replay, request.routing, dict(request.routing_weights), exclude,
                                              cache_salt=job.cache_salt)
        except NoWorkerError as e:
            self._abort(trace, context, grpc.StatusCode.UNAVAILABLE, str(e))
        except AdmissionRefused as e:
            retry_ms = int(e.retry_after_s * 1000)
            hint = f"; retry after {retry_ms} ms" if retry_ms else ""
            self._refuse(trace, context, f"{e}{hint}", e.retry_after_s)
        except ValueError as e:
            self._abort(trace, context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        trace.phase = _Phase.PLACED
        if trace.moving is not None:
            trace.moving.to_decode_worker = placement.decode.worker_id
            trace.moving.replayed_tokens = len(replay)
        return placement

    def _timeout(self, context) -> float:
        remaining = context.time_remaining()
        return self.deadlines.default_timeout_s if remaining is None else max(0.0, remaining)

    def _prefill_timeout(self, context) -> float:
        d = self.deadlines
        return min(d.prefill_timeout_s, d.prefill_deadline_fraction * self._timeout(context))

    def _remote_prefill(self, job: _Job, placement: Placement, trace: _Trace, context):
        if placement.prefill is None:
            return None
        trace.phase = _Phase.PREFILLING
        if not trace.generated:
            trace.prefill_started = time.perf_counter()
        request = worker_pb2.PrefillRequest(request_id=job.worker_rid,
                                            prompt_token_ids=[*job.prompt, *trace.generated],
                                            sampling=job.sampling, decode_target=placement.decode.address,
                                            decode_cached_blocks=placement.decode_cached_blocks,
                                            cache_salt=job.cache_salt)
        future = self.directory.prefill_stub(placement.prefill.address).Prefill.future(
            request, timeout=self._prefill_timeout(context))
        if not context.add_callback(future.cancel):  # the client is already gone
            future.cancel()
        try:
            reply = future.result()
        except grpc.FutureCancelledError:  # our callback: the client cancelled or its deadline passed
            raise _ClientGone from None
        except grpc.RpcError as e:
            return self._prefill_failed(e, job.worker_rid, placement, trace, context)
        if not trace.generated:  # (a migration's replay is accounted in its Migration)
            trace.prefill_ms, trace.transfer_ms = reply.prefill_ms, reply.transfer_ms
        self.metrics.remote_prefills.labels(outcome="ok").inc()
        return reply

    def _prefill_failed(self, e: grpc.RpcError, rid: str, placement: Placement, trace: _Trace, context):
        if e.code() in NOT_FALLBACK or not context.is_active():
            self._abort(trace, context, e.code(), e.details() or e.code().name)
        self.metrics.remote_prefills.labels(outcome="fallback").inc()
        log.warning("request %s: prefill on %s failed (%s: %s); prefilling on decode worker %s",
                    rid, placement.prefill.worker_id, e.code().name, e.details(), placement.decode.worker_id)
        return None

    def _decode(self, job: _Job, placement: Placement, prefill, trace: _Trace, context):
        """Relay the decode worker's replies. None when the stream finished (or the client left);
        the _Break when the worker broke it and the client is still there (_after_break decides)."""
        request = worker_pb2.DecodeRequest(request_id=job.worker_rid, prompt_token_ids=job.prompt,
                                           sampling=job.sampling, prefill_here=prefill is None,
                                           detokenize=True, cache_salt=job.cache_salt,
                                           generated_token_ids=trace.generated)
        if prefill is not None:
            request.first_token = prefill.first_token
            if prefill.HasField("first_logprob"):
                request.first_logprob.CopyFrom(prefill.first_logprob)
        call = self.directory.decode_stub(placement.decode.address).Decode(request,
                                                                           timeout=self._timeout(context))
        if not context.add_callback(call.cancel):  # the client is already gone
            call.cancel()
        trace.phase = _Phase.DECODING
        try:
            for reply in call:
                yield self._response(job, reply, placement, prefill, trace)
        except grpc.RpcError as e:
            if context.is_active():
                return _Break(e.code(), e.details() or "")
        return None

    def _response(self, job: _Job, reply, placement: Placement, prefill, trace: _Trace):
        now, first = time.perf_counter(), False
        if trace.first_token is None:
            trace.first_token = now
            self.metrics.ttft.observe(now - trace.received)
            trace.prompt_usage = prefill.usage if prefill is not None else reply.usage
            if prefill is None:
                trace.prefill_ms = reply.prefill_ms
            first = True
        elif trace.moving is not None:
            self._moved(trace.moving, reply, prefill, now - trace.last_token)
            trace.moving = None
        if reply.token_ids:
            if trace.last_token is not None:
                self.metrics.itl.observe(now - trace.last_token)
            trace.last_token = now
            trace.generated.extend(reply.token_ids)
            self.metrics.generated_tokens.inc(len(reply.token_ids))
        out = generation_pb2.GenerateResponse(request_id=job.rid, text=reply.text, token_ids=reply.token_ids,
                                              finished=reply.finished, finish_reason=reply.finish_reason,
                                              logprobs=reply.logprobs)
        if first:
            out.seed = job.sampling.seed  # what a client-side resume must send again
        if reply.finished:
            trace.code = "OK"
            trace.usage = _usage(len(job.prompt), trace.prompt_usage, reply.usage)
            out.usage.CopyFrom(trace.usage)
            out.timings.CopyFrom(_timings(trace))
            out.decode_worker = placement.decode.worker_id
            out.prefill_worker = placement.prefill.worker_id if prefill is not None else ""
            out.migrations.extend(trace.migrations)
            if not trace.migrations:  # a replay's placement was not what the index was asked about
                self._check_prediction(placement, prefill, trace.usage)
        return out

    def _check_prediction(self, placement: Placement, prefill, usage: generation_pb2.Usage) -> None:
        """What the index promised the worker that computed the prompt, against what it reused; a
        worker whose predictions keep missing is asked to republish its entries (router/prediction.py)."""
        predicted = placement.predicted_cached_tokens
        if predicted is None or (placement.prefill is not None and prefill is None):
            return  # no prediction, or the remote prefill fell back: the decode worker computed it
        worker, m = placement.computing_worker, self.metrics
        m.predicted_tokens.labels(worker=worker.worker_id).inc(predicted)
        m.reused_tokens.labels(worker=worker.worker_id).inc(usage.cached_tokens)
        m.prediction_error.observe(abs(predicted - usage.cached_tokens))
        if self.predictions.record(worker.worker_id, predicted, usage.cached_tokens):
            self._ask_resync(worker.worker_id, worker.address)
        accuracy = self.predictions.accuracy(worker.worker_id)
        if accuracy is not None:
            m.index_accuracy.labels(worker=worker.worker_id).set(accuracy)

    def _ask_resync(self, worker_id: str, address: str) -> None:
        log.warning("the prefix index's predictions for %s fell below %.2f accuracy; asking it to "
                    "republish its entries", worker_id, self.predictions.check.threshold)
        future = self.directory.stub(address).ResyncIndex.future(worker_pb2.ResyncIndexRequest(), timeout=5.0)
        outcome = lambda f: "ok" if f.exception() is None else "failed"
        future.add_done_callback(lambda f: self.metrics.index_resyncs.labels(worker=worker_id,
                                                                             outcome=outcome(f)).inc())

    def _moved(self, migration: generation_pb2.Migration, first, prefill, gap_s: float) -> None:
        """The first reply after a migration: what its replay cost, and the gap the client saw."""
        migration.cached_tokens = (prefill.usage if prefill is not None else first.usage).cached_tokens
        migration.gap_ms = gap_s * 1e3
        self.metrics.migration_gap.observe(gap_s)


def _usage(prompt_tokens: int, prompt: generation_pb2.Usage,
           last: generation_pb2.Usage) -> generation_pb2.Usage:
    """The whole request's: its prompt, cached and computed where it was first served, and every token
    generated (the last decode worker counts those sent before a migration too)."""
    return generation_pb2.Usage(prompt_tokens=prompt_tokens, cached_tokens=prompt.cached_tokens,
                                computed_tokens=prompt.computed_tokens,
                                completion_tokens=last.completion_tokens,
                                host_cached_tokens=prompt.host_cached_tokens,
                                disk_cached_tokens=prompt.disk_cached_tokens)


def _timings(trace: _Trace) -> generation_pb2.Timings:
    start = trace.prefill_started or trace.received
    return generation_pb2.Timings(queue_ms=(start - trace.received) * 1e3, prefill_ms=trace.prefill_ms,
                                  transfer_ms=trace.transfer_ms,
                                  ttft_ms=((trace.first_token or start) - trace.received) * 1e3)
