"""Concurrent-call limits on a gRPC server: a call past its limit is refused at once, never queued.

Why: a sync gRPC server runs each call on a pool thread for as long as the call lasts, and a
streaming call whose client sends nothing (a reflection stream, a Health.Watch, a KV push
stalled after BEGIN) holds its thread until the client goes away. Without a limit per kind
of call, a few hundred such streams take every thread and the calls that matter (Generate,
Decode) are refused. So each kind of call gets its own CallLimit, the server's thread pool is
sized to the sum of the limits plus a few spare, and gRPC's own cap on concurrent calls
stays as the backstop.

Lifecycle of one call that a limit covers (CallLimiter, a server interceptor):

    arrives -> ADMITTED (counted) -> the handler runs -> it returns, or its response stream
            ends or is closed (cancel, deadline) -> uncounted
            (a non-blocking streaming handler, such as grpc_health's Watch, holds no thread:
            it stays counted until its call ends)
    arrives with the limit reached -> REFUSED: RESOURCE_EXHAUSTED at once, with a message naming
            the limit and the setting that raises it, and a retry-after-ms trailer; the handler
            never runs

Put the limiter after the authentication interceptors, so a call they refuse is never counted.
A method no limit covers passes through untouched.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.descriptor import ServiceDescriptor

RETRY_AFTER_KEY = "retry-after-ms"


def method_paths(service: ServiceDescriptor, *names: str) -> tuple[str, ...]:
    """gRPC method paths ('/pdserve.v1.Worker/Status') of the named methods (all when none named)."""
    chosen = names or tuple(m.name for m in service.methods)
    return tuple(f"/{service.full_name}/{service.methods_by_name[n].name}" for n in chosen)


def service_prefix(service: ServiceDescriptor) -> str:
    """The path prefix that covers every method of service, e.g. '/pdserve.v1.Worker/'."""
    return f"/{service.full_name}/"


@dataclass(frozen=True)
class CallLimit:
    """At most max_calls calls of the covered methods at once.

    include / exclude hold method paths ('/pkg.Service/Method') or service prefixes ending in
    '/' ('/pkg.Service/'); a method is covered when it matches include and not exclude.
    setting names what raises the limit, for the refusal message.
    """

    name: str
    max_calls: int
    setting: str
    include: tuple[str, ...]
    exclude: tuple[str, ...] = ()
    retry_after_s: float = 1.0

    def __post_init__(self) -> None:
        if self.max_calls < 1:
            raise ValueError(f"{self.setting} must be >= 1, got {self.max_calls}")
        if not self.include:
            raise ValueError(f"call limit {self.name!r} covers no method: give include")

    def covers(self, method: str) -> bool:
        return _matches(method, self.include) and not _matches(method, self.exclude)

    def refusal(self, in_flight: int) -> str:
        return (f"{in_flight:,} {self.name} are open on this server; its limit is {self.max_calls:,} "
                f"({self.setting}); retry after {int(self.retry_after_s * 1000)} ms")


def _matches(method: str, patterns: Collection[str]) -> bool:
    return any(method == p or (p.endswith("/") and method.startswith(p)) for p in patterns)


@dataclass(frozen=True)
class LimitCounts:
    in_flight: int
    refused: int  # since the server started


class _Gate:
    """One limit's count of admitted calls."""

    def __init__(self, limit: CallLimit) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._in_flight = 0
        self._refused = 0

    def enter(self, context: grpc.ServicerContext) -> None:
        """Count the call in, or abort it with RESOURCE_EXHAUSTED when the limit is reached."""
        with self._lock:
            if self._in_flight < self.limit.max_calls:
                self._in_flight += 1
                return
            self._refused += 1
            in_flight = self._in_flight
        context.set_trailing_metadata(((RETRY_AFTER_KEY, str(int(self.limit.retry_after_s * 1000))),))
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, self.limit.refusal(in_flight))

    def leave(self) -> None:
        with self._lock:
            self._in_flight -= 1

    def counts(self) -> LimitCounts:
        with self._lock:
            return LimitCounts(self._in_flight, self._refused)


_HANDLER_KINDS: dict[tuple[bool, bool], Callable[..., grpc.RpcMethodHandler]] = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def _behavior(handler: grpc.RpcMethodHandler) -> Callable[..., Any]:
    return (handler.unary_unary or handler.unary_stream or handler.stream_unary
            or handler.stream_stream)


class _Once:
    def __init__(self, action: Callable[[], None]) -> None:
        self._action, self._lock, self._done = action, threading.Lock(), False

    def __call__(self) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
        self._action()


def _limited(handler: grpc.RpcMethodHandler, gate: _Gate) -> grpc.RpcMethodHandler:
    """handler, counted by gate from the moment it starts until its call's work is over."""
    behavior = _behavior(handler)
    if getattr(behavior, "experimental_non_blocking", False):
        # NOTE: gRPC hands such a handler a send_response_callback and frees the thread when it
        # returns; a generator in its place would hold the thread for the whole stream.
        def run(request: Any, context: grpc.ServicerContext, send_response_callback: Any = None) -> Any:
            gate.enter(context)
            leave = _Once(gate.leave)
            if not context.add_callback(leave):  # the call has already ended
                leave()
            return behavior(request, context, send_response_callback)

        run.experimental_non_blocking = True
        run.experimental_thread_pool = getattr(behavior, "experimental_thread_pool", None)
    elif handler.response_streaming:
        def run(request_or_iterator: Any, context: grpc.ServicerContext) -> Any:
            gate.enter(context)  # NOTE: runs at the first next(), on the call's pool thread
            try:
                yield from behavior(request_or_iterator, context)
            finally:  # the stream ended, or gRPC closed it (cancel, deadline, client gone)
                gate.leave()
    else:
        def run(request_or_iterator: Any, context: grpc.ServicerContext) -> Any:
            gate.enter(context)
            try:
                return behavior(request_or_iterator, context)
            finally:
                gate.leave()
    make = _HANDLER_KINDS[(handler.request_streaming, handler.response_streaming)]
    return make(run, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


class CallLimiter(grpc.ServerInterceptor):
    """Applies CallLimits to a server's calls; the first limit that covers a method applies."""

    def __init__(self, limits: Sequence[CallLimit]) -> None:
        names = [limit.name for limit in limits]
        if len(set(names)) != len(names):
            raise ValueError(f"call limits need distinct names, got {names}")
        self._gates = [_Gate(limit) for limit in limits]

    @property
    def total_calls(self) -> int:
        """The most calls the limits admit at once, all together (for sizing the thread pool)."""
        return sum(g.limit.max_calls for g in self._gates)

    def counts(self) -> dict[str, LimitCounts]:
        return {g.limit.name: g.counts() for g in self._gates}

    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Any],
                          handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(handler_call_details)
        if handler is None:
            return None  # gRPC answers UNIMPLEMENTED
        gate = next((g for g in self._gates if g.limit.covers(handler_call_details.method)), None)
        return handler if gate is None else _limited(handler, gate)


# --- the open services' streams ----------------------------------------------------------------
# Health and reflection need no credential (pdserve/security/auth.py EXEMPT_METHODS), so anyone
# who can connect may open them: these limits are what keeps them from holding every thread.
# Health.Check is unary and quick: it is left to the server's spare threads.
HEALTH_WATCH_METHOD = "/grpc.health.v1.Health/Watch"
REFLECTION_METHODS = ("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                      "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo")


def health_watch_limit(max_calls: int, setting: str) -> CallLimit:
    return CallLimit("Health.Watch streams", max_calls, setting, (HEALTH_WATCH_METHOD,))


def reflection_limit(max_calls: int, setting: str) -> CallLimit:
    return CallLimit("reflection streams", max_calls, setting, REFLECTION_METHODS)
