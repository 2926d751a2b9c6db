"""A fake router for the load generator's tests: a real gRPC `Generation` server on a free
loopback port, in this process, that streams max_tokens tokens with small sleeps.

It records every request, tracks how many calls are in flight (and the most at once), can
fail chosen requests with RESOURCE_EXHAUSTED, and counts what it served in Prometheus
counters named like the router's, exposed on a loopback HTTP port.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass

import grpc
from prometheus_client import CollectorRegistry, Counter, start_http_server

from protos.pdserve.v1 import generation_pb2 as pb
from protos.pdserve.v1 import generation_pb2_grpc as pb_grpc

PROMPT_TOKENS = 100
CACHED_TOKENS = 25


def reply_text(request_id: str) -> str:
    return f"reply to {request_id}"


class RouterCounters:
    """The router's counters that loadtest's server metrics read (pdserve_router_*), on a registry of
    the fake's own; every served request has PROMPT_TOKENS, CACHED_TOKENS of them cached."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests_total = Counter("pdserve_router_requests", "calls by code", ["code"],
                                      registry=self.registry)
        self.prompt_tokens = Counter("pdserve_router_prompt_tokens", "prompt tokens", registry=self.registry)
        self.cached_tokens = Counter("pdserve_router_cached_tokens", "cached tokens", registry=self.registry)
        self.generated_tokens = Counter("pdserve_router_generated_tokens", "generated",
                                        registry=self.registry)

    def count_served(self, generated: int) -> None:
        self.requests_total.labels("OK").inc()
        self.prompt_tokens.inc(PROMPT_TOKENS)
        self.cached_tokens.inc(CACHED_TOKENS)
        self.generated_tokens.inc(generated)

    def count_refused(self) -> None:
        self.requests_total.labels("RESOURCE_EXHAUSTED").inc()


class FakeRouter(RouterCounters, pb_grpc.GenerationServicer):
    """Knobs: `token_sleep_s` (before each token message), `tokens_per_message`,
    `fail_if(request) -> bool` (abort that call with RESOURCE_EXHAUSTED before any token)."""

    def __init__(self, token_sleep_s: float = 0.005, tokens_per_message: int = 1,
                 fail_if: Callable[[pb.GenerateRequest], bool] = lambda request: False) -> None:
        self.token_sleep_s, self.tokens_per_message, self.fail_if = token_sleep_s, tokens_per_message, fail_if
        self.requests: list[pb.GenerateRequest] = []
        self.in_flight = self.max_in_flight = 0
        self._lock = threading.Lock()
        RouterCounters.__init__(self)

    def Generate(self, request, context):  # noqa: N802 (the gRPC method name)
        with self._lock:
            self.requests.append(request)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.fail_if(request):
                self.count_refused()
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "fake router: no KV blocks free")
            yield from self._stream(request)
        finally:
            with self._lock:
                self.in_flight -= 1

    def _stream(self, request: pb.GenerateRequest) -> Iterator[pb.GenerateResponse]:
        n = request.sampling.max_tokens
        text = reply_text(request.request_id)
        sent = 0
        while sent < n:
            time.sleep(self.token_sleep_s)
            k = min(self.tokens_per_message, n - sent)
            # the whole reply text rides on the first message, so a reply's text is known
            yield pb.GenerateResponse(request_id=request.request_id, text=text if sent == 0 else "",
                                      token_ids=list(range(sent, sent + k)))
            sent += k
        self.count_served(n)
        yield pb.GenerateResponse(
            request_id=request.request_id, finished=True, finish_reason="length",
            usage=pb.Usage(prompt_tokens=PROMPT_TOKENS, cached_tokens=CACHED_TOKENS,
                           computed_tokens=PROMPT_TOKENS - CACHED_TOKENS, completion_tokens=n),
            timings=pb.Timings(queue_ms=1.0, prefill_ms=2.0, ttft_ms=3.0),
            prefill_worker="p0", decode_worker="d0")


@dataclass(frozen=True)
class Serving:
    target: str  # HOST:PORT of the gRPC server
    metrics_url: str | None


@contextlib.contextmanager
def serving(fake: FakeRouter, *, metrics: bool = False) -> Iterator[Serving]:
    """Serve fake on a free loopback port; with metrics, its counters over HTTP too (that
    server takes half a second to shut down, so only the tests that scrape ask for it)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    pb_grpc.add_GenerationServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    http = start_http_server(0, addr="127.0.0.1", registry=fake.registry)[0] if metrics else None
    try:
        url = f"http://127.0.0.1:{http.server_port}/metrics" if http else None
        yield Serving(f"127.0.0.1:{port}", url)
    finally:
        if http:
            http.shutdown()
            http.server_close()
        server.stop(None)
