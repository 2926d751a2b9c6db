"""Python client for the router's public gRPC API, `pdserve.v1.Generation`.

    with PdserveClient("127.0.0.1:50051") as client:
        with client.stream("Name three colours.", max_tokens=32) as stream:
            for delta in stream.deltas():
                print(delta.text, end="", flush=True)
            completion = stream.result()
        completion = client.generate(messages=[{"role": "user", "content": "Hi"}])

`AsyncPdserveClient` is the same over `grpc.aio` (`async for`, `await ...result()`).

Either takes several routers, "a:1,b:2": calls are spread over them round robin, and a call that
fails UNAVAILABLE before its first response is retried on the next one (pdserve/router_targets.py).

A stream's lifecycle: Open -> Streaming -> Finished (a message with finished=true arrived),
Failed (PdserveError), or Cancelled (`.cancel()`, or leaving its `with` block before the
end). Cancelling closes the gRPC call; the router sees its context cancelled and frees the
request's KV blocks on every worker. The client's deadline (timeout_s) bounds the whole
request, not each message.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from pdserve.engine.sequence import TokenLogprob  # NOTE: pure, no torch: the client stays light
from pdserve.roles import CHAT_ROLES
from pdserve.router_targets import balancing_options, channel_target
from protos.pdserve.v1 import generation_pb2 as pb
from protos.pdserve.v1 import generation_pb2_grpc as pb_grpc

DEFAULT_TARGET = "127.0.0.1:50051"
DEFAULT_TIMEOUT_S = 120.0
MAX_RESUMES = 2  # client-side resumes of one stream whose router died mid-way
MAX_MESSAGE_BYTES = 64 * 2**20
USAGE_FIELDS = ("prompt_tokens", "cached_tokens", "computed_tokens", "completion_tokens",
                "host_cached_tokens", "disk_cached_tokens")  # the last two: of cached_tokens, per KV tier
TIMING_FIELDS = ("queue_ms", "prefill_ms", "transfer_ms", "ttft_ms")
MIGRATION_FIELDS = ("cause", "from_decode_worker", "to_decode_worker", "after_tokens", "replayed_tokens",
                    "cached_tokens", "gap_ms")
# Substrings of gRPC's own status details when no connection could be made at all.
_NO_CONNECTION = ("failed to connect", "connection refused", "dns resolution failed",
                  "connections to all backends failing")


class _Default(enum.Enum):
    """Marks a per-call argument as not given, so the client's own setting applies."""

    CLIENT = "client"


CLIENT_DEFAULT = _Default.CLIENT


class PdserveError(Exception):
    """A failed request: `code` is the gRPC status name, e.g. "INVALID_ARGUMENT"."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class RouterUnreachable(PdserveError):
    """No connection to the router could be made (code UNAVAILABLE)."""

    def __init__(self, target: str, details: str):
        super().__init__("UNAVAILABLE", f"cannot reach the router at {target}; is `pdserve up` running?")
        self.target = target
        self.details = details


@dataclass(frozen=True)
class Delta:
    text: str
    token_ids: list[int]


@dataclass
class Completion:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str  # stop | length | abort
    usage: dict[str, int]  # USAGE_FIELDS
    timings: dict[str, float]  # TIMING_FIELDS, in milliseconds
    prefill_worker: str | None  # None: the prompt was prefilled on the decode worker
    decode_worker: str
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token, when asked for
    # Each move of the stream to another decode worker after its own broke (MIGRATION_FIELDS); the
    # tokens and text are one unbroken stream all the same.
    migrations: list[dict[str, Any]] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        """The object `pdserve generate --json` prints."""
        return {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
                "usage": self.usage, "timings": self.timings}


# --- requests -----------------------------------------------------------------------------------

def request_from(prompt: str | None = None, *, messages: Sequence[Mapping[str, str]] | None = None,
                 token_ids: Sequence[int] | None = None, raw: bool = False, request_id: str | None = None,
                 temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                 seed: int | None = None, max_tokens: int | None = None,
                 stop: str | Sequence[str] | None = None, stop_token_ids: Sequence[int] | None = None,
                 ignore_eos: bool = False, logprobs: int | None = None, routing: str | None = None,
                 routing_weights: Mapping[str, float] | None = None) -> pb.GenerateRequest:
    """Build a GenerateRequest. Give exactly one of prompt, messages or token_ids.

    logprobs: k asks for each token's logprob and its k most likely alternatives (the router
    allows 0..20); None asks for none.

    Sampling fields left as None stay unset, so the router's defaults apply (see the proto).
    routing (prefix | least_load | round_robin) and routing_weights override the router's
    placement policy for this request.
    Values are range-checked by the router, which answers INVALID_ARGUMENT.
    """
    given = [name for name, value in (("prompt", prompt), ("messages", messages), ("token_ids", token_ids))
             if value is not None]
    if len(given) != 1:
        got = ", ".join(given) if given else "none"
        raise ValueError(f"give exactly one of prompt, messages or token_ids (got: {got})")
    if raw and prompt is None:
        raise ValueError("raw=True applies only to a text prompt (messages always use the chat "
                         "template; token_ids are sent as is)")
    if prompt is not None and not isinstance(prompt, str):
        raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
    request = pb.GenerateRequest(request_id=request_id or "", raw=raw)
    if prompt is not None:
        request.text = prompt
    elif messages is not None:
        request.chat.messages.extend(_chat_messages(messages))
    else:
        request.token_ids.ids.extend(_token_ids(token_ids, "token_ids"))
    request.sampling.CopyFrom(_sampling(temperature, top_k, top_p, seed, max_tokens, stop,
                                        stop_token_ids, ignore_eos, logprobs))
    request.routing = routing or ""
    request.routing_weights.update(routing_weights or {})
    return request


def _sampling(temperature, top_k, top_p, seed, max_tokens, stop, stop_token_ids,
              ignore_eos, logprobs) -> pb.SamplingParams:
    given = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed,
             "max_tokens": max_tokens, "logprobs": logprobs}
    sampling = pb.SamplingParams(**{k: v for k, v in given.items() if v is not None})
    if stop is not None:
        sampling.stop.extend([stop] if isinstance(stop, str) else list(stop))
    if stop_token_ids is not None:
        sampling.stop_token_ids.extend(_token_ids(stop_token_ids, "stop_token_ids"))
    sampling.ignore_eos = ignore_eos
    return sampling


def _chat_messages(messages: Sequence[Mapping[str, str]]) -> list[pb.ChatMessage]:
    if isinstance(messages, (str, bytes)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...}")
    out = []
    for i, m in enumerate(messages):
        role, content = (m.get("role"), m.get("content")) if isinstance(m, Mapping) else (None, None)
        if role not in CHAT_ROLES or not isinstance(content, str):
            raise ValueError(f"messages[{i}] must be {{'role': one of {', '.join(CHAT_ROLES)}, "
                             f"'content': str}}, got {m!r}")
        out.append(pb.ChatMessage(role=role, content=content))
    return out


def _token_ids(ids: Iterable[int], name: str) -> list[int]:
    out = list(ids)
    for i, t in enumerate(out):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < 2**32:
            raise ValueError(f"{name}[{i}] = {t!r} is not a token id (an integer in 0..2**32-1)")
    return out


# --- responses and errors -----------------------------------------------------------------------

@dataclass
class _Collector:
    """Folds a response stream into a Completion."""

    request_id: str = ""
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    last: pb.GenerateResponse | None = None
    seed: int | None = None  # the first message's: what a resume sends again

    def add(self, response: pb.GenerateResponse) -> None:
        if self.seed is None:
            self.seed = response.seed
        self.request_id = self.request_id or response.request_id
        self.text.append(response.text)
        self.token_ids.extend(response.token_ids)
        self.logprobs.extend(_token_logprob(lp) for lp in response.logprobs)
        if response.finished:
            self.last = response

    def completion(self) -> Completion:
        last = self.last
        if last is None:
            raise PdserveError("INTERNAL", "the router ended the stream without its final message "
                                           "(finished=true); the answer may be cut short")
        return Completion(
            request_id=self.request_id, text="".join(self.text), token_ids=list(self.token_ids),
            finish_reason=last.finish_reason,
            usage={k: getattr(last.usage, k) for k in USAGE_FIELDS},
            timings={k: getattr(last.timings, k) for k in TIMING_FIELDS},
            prefill_worker=last.prefill_worker or None, decode_worker=last.decode_worker,
            logprobs=list(self.logprobs),
            migrations=[{k: getattr(m, k) for k in MIGRATION_FIELDS} for m in last.migrations])


def _token_logprob(p: pb.TokenLogprob) -> TokenLogprob:
    """NOTE: pdserve/worker/convert.py has the same conversion, but imports torch, which a client need not."""
    return TokenLogprob(p.token_id, p.logprob, tuple((t.token_id, t.logprob) for t in p.top))


def error_from(exc: grpc.RpcError, target: str, timeout_s: float | None,
               received_any: bool) -> PdserveError:
    """Map a gRPC error to PdserveError, with a hint where gRPC's own text gives none."""
    code, details = exc.code(), exc.details() or ""
    if (code == grpc.StatusCode.UNAVAILABLE and not received_any
            and any(s in details.lower() for s in _NO_CONNECTION)):
        return RouterUnreachable(target, details)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED and timeout_s is not None and "Deadline Exceeded" in details:
        details = (f"no complete answer within the {timeout_s:g} s deadline; "
                   "pass a larger timeout_s, or None for no deadline")
    name = code.name if code is not None else "UNKNOWN"
    return PdserveError(name, details or name.lower().replace("_", " "))


def channel_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, object]]:
    return [("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes)]


# --- sync ---------------------------------------------------------------------------------------

class _Resume:
    """Client-side resume of one stream (both clients): when the call fails UNAVAILABLE after tokens
    arrived and before its last message (its router died), the same request goes again with those
    tokens as its continuation and the seed the first message named (protos:
    GenerateRequest.continuation), at most MAX_RESUMES times; with several routers the channel sends
    it to another. The stream goes on where it broke, with the tokens an unbroken one would have."""

    def __init__(self, request: pb.GenerateRequest | None, collector: _Collector) -> None:
        self.request, self.collector = request, collector
        self.count = 0

    def possible(self, exc: grpc.RpcError, can_reopen: bool) -> bool:
        return (can_reopen and self.request is not None and self.count < MAX_RESUMES
                and exc.code() == grpc.StatusCode.UNAVAILABLE and bool(self.collector.token_ids)
                and self.collector.last is None)

    def next_request(self) -> pb.GenerateRequest:
        self.count += 1
        request = pb.GenerateRequest()
        request.CopyFrom(self.request)
        request.sampling.seed = self.collector.seed or 0
        del request.continuation.ids[:]
        request.continuation.ids.extend(self.collector.token_ids)
        return request


class _Call:
    """What both streams keep of one Generate call: its responses so far and how to resume it."""

    def __init__(self, call: Any, target: str, timeout_s: float | None,
                 request: pb.GenerateRequest | None = None,
                 reopen: Callable[[pb.GenerateRequest], Any] | None = None):
        self._call, self._target, self._timeout_s = call, target, timeout_s
        self._reopen = reopen
        self._collector = _Collector()
        self._resume = _Resume(request, self._collector)
        self._received_any = self._cancelled = False

    @property
    def resumes(self) -> int:
        return self._resume.count

    def _received(self, response: pb.GenerateResponse) -> pb.GenerateResponse:
        self._received_any = True
        self._collector.add(response)
        return response

    def _call_after(self, exc: grpc.RpcError) -> Any | None:
        """The resumed call after the call failed with exc; None: the stream ends quietly (we
        cancelled it); PdserveError when it can be neither."""
        if self._cancelled and exc.code() == grpc.StatusCode.CANCELLED:
            return None
        if not self._resume.possible(exc, self._reopen is not None):
            raise error_from(exc, self._target, self._timeout_s, self._received_any) from None
        return self._reopen(self._resume.next_request())


class GenerationStream(_Call):
    """One Generate call. Iterate for the raw GenerateResponse messages, or use deltas(). A stream
    whose router dies is resumed through another (_Resume)."""

    def __iter__(self) -> Iterator[pb.GenerateResponse]:
        while True:
            try:
                for response in self._call:
                    yield self._received(response)
                return
            except grpc.RpcError as exc:
                resumed = self._call_after(exc)
                if resumed is None:
                    return
                self._call = resumed

    def deltas(self) -> Iterator[Delta]:
        """The text and token ids of each message that carries any."""
        for response in self:
            if response.text or response.token_ids:
                yield Delta(response.text, list(response.token_ids))

    def result(self) -> Completion:
        """Read what is left of the stream and return the whole completion."""
        for _ in self:
            pass
        if self._cancelled and self._collector.last is None:
            raise PdserveError("CANCELLED", "the stream was cancelled before it finished")
        return self._collector.completion()

    def cancel(self) -> None:
        """Cancel the call; the router frees the request. Iteration then ends quietly."""
        self._cancelled = True
        self._call.cancel()

    def __enter__(self) -> GenerationStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._call.cancel()  # a no-op once the call has ended


class PdserveClient:
    """Blocking client. `timeout_s` is the deadline of each request (None: no deadline)."""

    def __init__(self, target: str = DEFAULT_TARGET, *, timeout_s: float | None = DEFAULT_TIMEOUT_S,
                 metadata: Sequence[tuple[str, str]] | None = None, wait_for_ready: bool = False,
                 credentials: grpc.ChannelCredentials | None = None,
                 max_message_bytes: int = MAX_MESSAGE_BYTES):
        self.target, self.timeout_s = target, timeout_s
        self._metadata, self._wait_for_ready = tuple(metadata or ()), wait_for_ready
        options = channel_options(max_message_bytes) + balancing_options(target)
        dial = channel_target(target)
        self._channel = (grpc.secure_channel(dial, credentials, options) if credentials
                         else grpc.insecure_channel(dial, options))
        self._stub = pb_grpc.GenerationStub(self._channel)

    def stream(self, prompt: str | None = None, *, timeout_s: float | None | _Default = CLIENT_DEFAULT,
               **fields: Any) -> GenerationStream:
        """Start a request; `fields` are request_from's keywords (messages, token_ids, max_tokens...)."""
        request = request_from(prompt, **fields)
        deadline = self.timeout_s if timeout_s is CLIENT_DEFAULT else timeout_s
        def open_call(r: pb.GenerateRequest) -> Any:
            return self._stub.Generate(r, timeout=deadline, metadata=self._metadata or None,
                                       wait_for_ready=self._wait_for_ready)
        return GenerationStream(open_call(request), self.target, deadline, request, open_call)

    def generate(self, prompt: str | None = None, *,
                 timeout_s: float | None | _Default = CLIENT_DEFAULT, **fields: Any) -> Completion:
        """Run a request to the end and return its completion."""
        with self.stream(prompt, timeout_s=timeout_s, **fields) as stream:
            return stream.result()

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> PdserveClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# --- asyncio ------------------------------------------------------------------------------------

class AsyncGenerationStream(_Call):
    """One Generate call over grpc.aio: `async for` the responses, or `async for` deltas(). A stream
    whose router dies is resumed through another (_Resume)."""

    async def __aiter__(self) -> AsyncIterator[pb.GenerateResponse]:
        while True:
            try:
                async for response in self._call:
                    yield self._received(response)
                return
            except grpc.RpcError as exc:
                resumed = self._call_after(exc)
                if resumed is None:
                    return
                self._call = resumed
            except asyncio.CancelledError:
                # NOTE: grpc.aio raises CancelledError after call.cancel(). Only that one is
                # swallowed: a task cancelled from outside must still see its CancelledError.
                if self._cancelled and self._call.cancelled():
                    return
                raise

    async def deltas(self) -> AsyncIterator[Delta]:
        async for response in self:
            if response.text or response.token_ids:
                yield Delta(response.text, list(response.token_ids))

    async def result(self) -> Completion:
        async for _ in self:
            pass
        if self._cancelled and self._collector.last is None:
            raise PdserveError("CANCELLED", "the stream was cancelled before it finished")
        return self._collector.completion()

    def cancel(self) -> None:
        self._cancelled = True
        self._call.cancel()

    async def __aenter__(self) -> AsyncGenerationStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._call.cancel()  # a no-op once the call has ended


class AsyncPdserveClient:
    """asyncio client; create it inside the running event loop that will use it."""

    def __init__(self, target: str = DEFAULT_TARGET, *, timeout_s: float | None = DEFAULT_TIMEOUT_S,
                 metadata: Sequence[tuple[str, str]] | None = None, wait_for_ready: bool = False,
                 credentials: grpc.ChannelCredentials | None = None,
                 max_message_bytes: int = MAX_MESSAGE_BYTES):
        self.target, self.timeout_s = target, timeout_s
        self._metadata, self._wait_for_ready = tuple(metadata or ()), wait_for_ready
        options = channel_options(max_message_bytes) + balancing_options(target)
        dial = channel_target(target)
        self._channel = (grpc.aio.secure_channel(dial, credentials, options) if credentials
                         else grpc.aio.insecure_channel(dial, options))
        self._stub = pb_grpc.GenerationStub(self._channel)

    def stream(self, prompt: str | None = None, *, timeout_s: float | None | _Default = CLIENT_DEFAULT,
               **fields: Any) -> AsyncGenerationStream:
        request = request_from(prompt, **fields)
        deadline = self.timeout_s if timeout_s is CLIENT_DEFAULT else timeout_s
        def open_call(r: pb.GenerateRequest) -> Any:
            return self._stub.Generate(r, timeout=deadline, metadata=self._metadata or None,
                                       wait_for_ready=self._wait_for_ready)
        return AsyncGenerationStream(open_call(request), self.target, deadline, request, open_call)

    async def generate(self, prompt: str | None = None, *,
                       timeout_s: float | None | _Default = CLIENT_DEFAULT, **fields: Any) -> Completion:
        async with self.stream(prompt, timeout_s=timeout_s, **fields) as stream:
            return await stream.result()

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncPdserveClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
