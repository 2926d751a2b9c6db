"""The engine loop: one thread owns engine.step(); requests subscribe to their outputs.

    submit()/resume() --register a RequestStream--> engine.add_request / resume_transferred
    loop thread: while work: outputs = engine.step(observer); each output -> its stream's queue;
                 the duration of each step that had work goes to observe_step (a metric), to
                 steps_total / step_seconds_total (WorkerStatus), and with what the step computed
                 (LLMEngine.last_step), its start and the loop's own time before it to the step trace: the
                 latest STEP_TRACE_LEN steps, numbered from 1, which the Worker service's Steps
                 call reads (`pdserve sim calibrate --in-cluster` fits the simulator's costs to them)
    abort(): engine.abort (blocks freed now) and the stream ends with finish_reason "abort"
    abort_later(): the stream ends now; the loop drops the request, then runs after_drop, at its
    next turn (gRPC's call-end callbacks: they must not wait for the step in flight)
    a step that raises: every request in flight is aborted (blocks freed) and its stream ends
    with finish_reason "error"; the loop keeps serving new requests. After max_failed_steps
    failures in a row it calls on_failing once (the worker then takes itself out of routing:
    an engine that fails every step would otherwise fail every request sent to it, forever)

A stream is registered before its request reaches the engine, so no output is missed.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from pdserve.engine.llm_engine import InvalidRequestError, LLMEngine, RequestOutput, StepObserver
from pdserve.engine.scheduler import StepShape
from pdserve.engine.sequence import SamplingParams, TokenLogprob, Usage

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05  # also the cadence at which expired parked transfers are swept
STEP_TRACE_LEN = 8192  # steps the trace keeps: minutes of a busy worker, a few MB


@dataclass(frozen=True, slots=True)
class StepRecord:
    number: int  # 1 for the worker's first step with work: steps_total when it ended
    shape: StepShape
    seconds: float  # wall time of engine.step()
    gap_s: float | None = None  # since the step before ended, if the loop had work all along; None: it waited
    started_at: float = 0.0  # time.perf_counter() at its start (WorkerService.Steps: StepRecord.started_at)


@dataclass(frozen=True, slots=True)
class _PendingDrop:
    """A request abort_later ends: dropped at the loop's next turn, then after_drop runs there."""

    request_id: str
    after_drop: Callable[[], None] | None = None


class RequestStream:
    """Outputs of one request, in order; ends after the finished output."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._queue: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
        self.finished = False

    def put(self, output: RequestOutput) -> None:
        self._queue.put(output)

    def get(self, timeout: float | None = None) -> RequestOutput:
        """Next output; queue.Empty after timeout."""
        return self._queue.get(timeout=timeout)

    def __iter__(self) -> Iterator[RequestOutput]:
        while not self.finished:
            output = self._queue.get()
            self.finished = output.finished
            yield output


class EngineLoop:
    def __init__(self, engine: LLMEngine, observer: StepObserver | None = None, *, max_failed_steps: int = 3,
                 on_failing: Callable[[int], None] | None = None,
                 observe_step: Callable[[float], None] | None = None) -> None:
        self.engine = engine
        self.observer = observer  # the KV sender, on a worker that sends KV
        self.max_failed_steps = max_failed_steps
        self._on_failing = on_failing
        self._failed_in_a_row = 0
        self._observe_step = observe_step  # seconds of each step that had work to do
        self.steps_total = 0  # steps that had work, and their wall time: read lock-free by Status
        self.step_seconds_total = 0.0
        self._trace: deque[StepRecord] = deque(maxlen=STEP_TRACE_LEN)
        self._last_end: float | None = None  # perf_counter() when the latest step with work returned
        self._streams: dict[str, RequestStream] = {}
        self._wake = threading.Condition()
        self._aborts: list[_PendingDrop] = []  # abort_later's requests, dropped at the loop's next turn
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        self._thread.join(timeout=10)

    # --- requests ---------------------------------------------------------------------
    def submit(self, prompt: list[int], sampling: SamplingParams, request_id: str, *,
               detokenize: bool = True, cache_salt: bytes = b"",
               generated: Iterable[int] = ()) -> RequestStream:
        """Queue a request (generated: a continued one's tokens so far, LLMEngine.add_request);
        InvalidRequestError (nothing registered) when it is malformed."""
        stream = self._register(request_id)
        try:
            self.engine.add_request(prompt, sampling, request_id=request_id, detokenize=detokenize,
                                    cache_salt=cache_salt, generated=generated)
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        self._notify()
        return stream

    def resume(self, request_id: str, prompt: list[int], first_token: int, sampling: SamplingParams,
               detokenize: bool = True, cache_salt: bytes = b"", first_logprob: TokenLogprob | None = None,
               generated: Iterable[int] = ()) -> RequestStream | None:
        """Continue a transferred request; None when its KV is not parked here, InvalidRequestError
        (nothing registered, the parked KV freed) when the request does not fit it."""
        stream = self._register(request_id)
        try:
            first = self.engine.resume_transferred(request_id, prompt, first_token, sampling, detokenize,
                                                   cache_salt, first_logprob, generated)
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        if first is None:
            self._streams.pop(request_id, None)
            return None
        self._deliver(first)
        self._notify()
        return stream

    def abort(self, request_id: str) -> bool:
        """Drop a request now: waits for the step in flight (the engine's lock). False if unknown."""
        found = self.engine.abort(request_id)
        return self._end_stream(request_id) or found

    def abort_later(self, request_id: str, after_drop: Callable[[], None] | None = None) -> None:
        """End the request's stream now and drop the request at the loop's next turn, without waiting
        for the step in flight; then run after_drop there (what else needs the engine's lock: the
        prefill worker lets go of the blocks its transfer pinned). For gRPC's call-end callbacks: they
        run on the server's one event thread, and a wait there holds up every call of the worker, new
        ones included, until the step ends. A new call with the id before then (the router's retry)
        drops it first."""
        self._end_stream(request_id)
        with self._wake:
            self._aborts.append(_PendingDrop(request_id, after_drop))
            self._wake.notify_all()

    def _drop(self, pending: _PendingDrop, parked: bool = True) -> None:
        try:  # NOTE: one failed drop must not stop the loop for every other request
            self.engine.abort(pending.request_id, parked)
        except Exception:
            log.exception("dropping request %s after its call ended failed", pending.request_id)
        try:
            if pending.after_drop is not None:
                pending.after_drop()
        except Exception:
            log.exception("cleaning up after request %s's drop failed", pending.request_id)

    def _end_stream(self, request_id: str) -> bool:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.put(RequestOutput(request_id, [], "", True, "abort", Usage()))
        return stream is not None

    def num_streams(self) -> int:
        return len(self._streams)

    # --- the loop ---------------------------------------------------------------------------
    def _register(self, request_id: str) -> RequestStream:
        stream = RequestStream(request_id)
        with self._wake:
            if request_id in self._streams:
                raise InvalidRequestError(f"request_id {request_id!r} is already in flight on this worker")
            superseded = [p for p in self._aborts if p.request_id == request_id]
            if superseded:
                self._aborts = [p for p in self._aborts if p.request_id != request_id]
            self._streams[request_id] = stream
        for pending in superseded:  # an earlier call with this id ended and its drop is pending (a retry)
            self._drop(pending, parked=False)
        return stream

    def _notify(self) -> None:
        with self._wake:
            self._wake.notify_all()

    def _run(self) -> None:
        while True:
            with self._wake:
                if self._stopping:
                    return
                waited = not self.engine.has_unfinished() and not self._aborts
                if waited:
                    self._wake.wait(timeout=_IDLE_WAIT_S)
                aborts, self._aborts = self._aborts, []
            for pending in aborts:
                self._drop(pending)
            busy = self.engine.has_unfinished()
            started = time.perf_counter()
            # the loop's own time since the last step ended (delivering its outputs), if it had work all along
            gap = None if waited or self._last_end is None else started - self._last_end
            try:
                outputs = self.engine.step(self.observer)
            except Exception:  # NOTE: one bad step must not take the worker down with it
                if self._failed_in_a_row < self.max_failed_steps:  # then it is out of service: once is enough
                    log.exception("engine step failed; failing the %d requests in flight", len(self._streams))
                self._fail_in_flight()
                self._count_failure()
                continue
            self._failed_in_a_row = 0
            ended = time.perf_counter()
            self._last_end = ended if busy else None  # an idle turn is no step to measure a gap from
            if busy:
                self._count_step(started, ended - started, self.engine.last_step, gap)
            for output in outputs:
                self._deliver(output)

    def steps_after(self, number: int, up_to: int | None = None) -> list[StepRecord]:
        """The traced steps numbered above `number` (and at most `up_to`), oldest first: those the
        trace still holds."""
        last = self.steps_total if up_to is None else up_to
        trace = list(self._trace)  # one C call: atomic under the GIL
        return [r for r in trace if number < r.number <= last]

    def _count_step(self, started: float, seconds: float, shape: StepShape | None, gap: float | None) -> None:
        if shape is not None:  # None: the step only dropped preempted requests, it ran nothing
            # NOTE: traced before it is counted, so a reader that saw steps_total = n finds step n
            self._trace.append(StepRecord(self.steps_total + 1, shape, seconds, gap, started))
        self.steps_total += 1
        self.step_seconds_total += seconds
        if self._observe_step is not None:
            self._observe_step(seconds)

    def _count_failure(self) -> None:
        self._failed_in_a_row += 1
        if self._failed_in_a_row == self.max_failed_steps and self._on_failing is not None:
            self._on_failing(self._failed_in_a_row)

    def _fail_in_flight(self) -> None:
        for request_id in list(self._streams):
            try:
                self.engine.abort(request_id)
            except Exception:
                log.exception("could not abort %s after the failed step", request_id)
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.put(RequestOutput(request_id, [], "", True, "error", Usage()))

    def _deliver(self, output: RequestOutput) -> None:
        stream = self._streams.get(output.request_id)
        if stream is None:
            return
        if output.finished:
            self._streams.pop(output.request_id, None)
        stream.put(output)
