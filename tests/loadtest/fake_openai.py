"""A fake OpenAI-compatible server for the load generator's HTTP tests: a real aiohttp server on a
free loopback port, on a thread of its own, that streams max_tokens one-token chunks with small
sleeps, shaped as pdserve's router/http sends them (a role chunk, content chunks, the finishing
chunk with the `pdserve` extension, the usage chunk, data: [DONE]).

It records every body and Authorization header, tracks how many streams are in flight (and the
most at once), can refuse chosen requests with 429 and Retry-After, can require a bearer token,
and counts what it served in Prometheus counters named like the router's, on GET /metrics.
The numbers it reports match tests/loadtest/fake_router.py's, so both transports' reports of the
same workload can be compared field by field.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

from aiohttp import web
from prometheus_client import generate_latest

from tests.loadtest.fake_router import CACHED_TOKENS, PROMPT_TOKENS, RouterCounters

MODEL = "fake-model"


def reply_piece(serial: int, position: int) -> str:
    """The text of a reply's token at position: the reply of the serial-th request is
    "reply<serial> t1 t2 ...", one piece per token."""
    return f"reply{serial}" if position == 0 else f" t{position}"


class FakeOpenAI(RouterCounters):
    def __init__(self, token_sleep_s: float = 0.005, fail_if: Callable[[dict], bool] = lambda body: False,
                 api_token: str | None = None, models: tuple[str, ...] = (MODEL,)) -> None:
        self.token_sleep_s, self.fail_if = token_sleep_s, fail_if
        self.api_token, self.models = api_token, models
        self.bodies: list[dict[str, Any]] = []
        self.paths: list[str] = []
        self.replies: list[str] = []  # the text streamed for bodies[i]
        self.authorizations: list[str | None] = []
        self.in_flight = self.max_in_flight = 0
        RouterCounters.__init__(self)

    def app(self) -> web.Application:
        app = web.Application()
        app.add_routes([web.post("/v1/chat/completions", self._generate),
                        web.post("/v1/completions", self._generate),
                        web.get("/v1/models", self._models), web.get("/metrics", self._metrics)])
        return app

    def _refusal(self, request: web.Request) -> web.Response | None:
        if self.api_token is not None and request.headers.get("Authorization") != f"Bearer {self.api_token}":
            return _error(401, "invalid bearer token", "authentication_error")
        return None

    async def _models(self, request: web.Request) -> web.Response:
        return self._refusal(request) or web.json_response(
            {"object": "list", "data": [{"id": m, "object": "model"} for m in self.models]})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), content_type="text/plain")

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.paths.append(request.path)
        self.authorizations.append(request.headers.get("Authorization"))
        serial = len(self.bodies) - 1
        self.replies.append("")
        refusal = self._refusal(request)
        if refusal is not None:
            return refusal
        if self.fail_if(body):
            self.count_refused()
            return _error(429, "fake server: no KV blocks free", "rate_limit_error", {"Retry-After": "2"})
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self._stream(request, body, serial)
        finally:
            self.in_flight -= 1

    async def _stream(self, request: web.Request, body: dict, serial: int) -> web.StreamResponse:
        chat = request.path.endswith("/chat/completions")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        choice = (lambda text: {"delta": {"content": text}}) if chat else (lambda text: {"text": text})
        if chat:
            await _send(response, {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        n = body["max_tokens"]
        for position in range(n):
            await asyncio.sleep(self.token_sleep_s)
            piece = reply_piece(serial, position)
            self.replies[serial] += piece
            await _send(response, {"choices": [{"index": 0, "finish_reason": None, **choice(piece)}]})
        self.count_served(n)
        extension = {"prefill_worker": "p0", "decode_worker": "d0",
                     "computed_tokens": PROMPT_TOKENS - CACHED_TOKENS,
                     "timings": {"queue_ms": 1.0, "prefill_ms": 2.0, "transfer_ms": 0.0, "ttft_ms": 3.0}}
        empty = {"delta": {}} if chat else {"text": ""}
        await _send(response, {"choices": [{"index": 0, "finish_reason": "length", **empty}],
                               "pdserve": extension})
        await _send(response, {"choices": [], "usage": {
            "prompt_tokens": PROMPT_TOKENS, "completion_tokens": n, "total_tokens": PROMPT_TOKENS + n,
            "prompt_tokens_details": {"cached_tokens": CACHED_TOKENS}}})
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def _error(status: int, message: str, kind: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "param": None, "code": None}},
                             status=status, headers=headers)


async def _send(response: web.StreamResponse, payload: dict) -> None:
    await response.write(b"data: " + json.dumps(payload).encode() + b"\n\n")


@contextlib.contextmanager
def serving_openai(fake: FakeOpenAI) -> Iterator[str]:
    """Serve fake on a free loopback port on a thread of its own; yields the base URL."""
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(fake.app(), access_log=None)

    async def start() -> str:
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=10)
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()
