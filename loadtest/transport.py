"""How the load generator talks to a server: one interface, two implementations. Pure: no I/O.

    Transport                         what the runner calls (this file)
    grpc_transport.GrpcTransport      pdserve.v1.Generation over AsyncPdserveClient   --api grpc
    openai_transport.OpenAITransport  OpenAI's /v1/chat/completions and /v1/completions
                                      over aiohttp, streamed as server-sent events     --api openai

The runner turns each RequestSpec into an API-neutral GenerationRequest, hands it to
`Transport.stream(request, clock)` and gets back a Reply: what came back, timed on the runner's
clock. It never sees the wire, so the workloads, arrivals, records and report are the same for
both APIs.

A transport's life: `async with` (opens its connections) -> check(timeout_s) (the server answers,
else ValueError with a hint) -> metrics_url() -> stream(...) for every request, concurrently ->
closed. A stream that fails never raises: its Reply has the status (a gRPC status name, or what
the HTTP transport names in openai_protocol.py) and the server's message.

ReplyBuilder is the one way both implementations time a stream: sent() when the request goes
out, tokens(n) on each message that carries tokens, then finished(...) or failed(...).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from loadtest.workloads import Message

OK = "OK"
APIS = ("grpc", "openai")  # LoadTestConfig.api, --api
Clock = Callable[[], float]  # seconds on the runner's monotonic clock


@dataclass(frozen=True)
class Sampling:
    """Per-request sampling; None / empty = the server's default."""

    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False


@dataclass(frozen=True)
class GenerationRequest:
    """One request, as neither API spells it. Exactly one of messages and token_ids is non-empty."""

    request_id: str
    sampling: Sampling
    messages: tuple[Message, ...] = ()  # the whole conversation so far (multi-turn: replies included)
    token_ids: tuple[int, ...] = ()
    routing: str | None = None  # pdserve's per-request placement override (gRPC only)


@dataclass(frozen=True)
class Reply:
    """What came back for one request; the fields RequestRecord shares are named as there."""

    send_s: float
    end_s: float
    status: str  # OK, or why it failed
    error: str | None = None
    token_times_s: tuple[float, ...] = ()  # receipt of each message that carried tokens
    token_counts: tuple[int, ...] = ()
    text: str = ""  # the reply text (multi-turn feeds it back as the assistant's message)
    usage: Mapping[str, int] | None = None  # prompt_tokens, cached_tokens, completion_tokens, ...
    server_timings_ms: Mapping[str, float] | None = None
    prefill_worker: str | None = None
    decode_worker: str | None = None
    finish_reason: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == OK

    def record_fields(self) -> dict[str, Any]:
        """The RequestRecord keywords this reply fills (the spec fills the rest)."""
        return {"send_s": self.send_s, "end_s": self.end_s, "status": self.status, "error": self.error,
                "token_times_s": self.token_times_s, "token_counts": self.token_counts, "usage": self.usage,
                "server_timings_ms": self.server_timings_ms, "prefill_worker": self.prefill_worker,
                "decode_worker": self.decode_worker, "finish_reason": self.finish_reason}


class Transport(Protocol):
    target: str  # where the requests go, for the report: HOST:PORT or a URL

    async def __aenter__(self) -> Transport: ...

    async def __aexit__(self, *exc_info: object) -> None: ...

    async def check(self, timeout_s: float) -> None:
        """Return once the server answers; ValueError (a user error, with a hint) if it does not in time."""

    async def metrics_url(self) -> str | None:
        """The server's Prometheus endpoint, when the server says or the API implies one."""

    async def stream(self, request: GenerationRequest, clock: Clock) -> Reply:
        """Send request, read its stream to the end and time it; never raises for a failed request."""


@dataclass
class ReplyBuilder:
    """The timing of one stream, shared by both transports."""

    clock: Clock
    send_s: float = 0.0
    times: list[float] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)

    def sent(self) -> None:
        self.send_s = self.clock()

    def tokens(self, count: int, at: float | None = None) -> None:
        """A message with count > 0 tokens arrived (now, or at the given receipt time)."""
        self.times.append(self.clock() if at is None else at)
        self.counts.append(count)

    def uncounted(self, count: int) -> None:
        """count tokens the server generated but sent in no message: they join the last one (or,
        with none, make one now)."""
        if count <= 0:
            return
        if self.counts:
            self.counts[-1] += count
        else:
            self.tokens(count)

    def text(self, text: str) -> None:
        if text:
            self.texts.append(text)

    def finished(self, **final: Any) -> Reply:
        """OK, with the final message's usage, server timings, workers and finish reason."""
        return self._reply(OK, None, final)

    def failed(self, status: str, error: str, **final: Any) -> Reply:
        return self._reply(status, error, final)

    def _reply(self, status: str, error: str | None, final: Mapping[str, Any]) -> Reply:
        return Reply(send_s=self.send_s, end_s=self.clock(), status=status, error=error,
                     token_times_s=tuple(self.times), token_counts=tuple(self.counts),
                     text="".join(self.texts), **final)
