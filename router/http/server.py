"""HttpFrontDoor: the OpenAI-compatible HTTP API, served by the router process beside gRPC.

    POST /v1/chat/completions   chat, whole or streamed (server-sent events, ended by [DONE])
    POST /v1/completions        a string or token-id prompt, whole or streamed
    GET  /v1/models[/{id}]      the served model, its context length, the sampling defaults
    GET  /health                200 while a decode worker is live, else 503
    GET  /metrics               the router's Prometheus registry (the one gRPC's calls count in)

A request: bearer token (the router's API tokens; /health and /metrics stay open, as gRPC's
health does) -> JSON body -> router/http/protocol.py -> GenerationServicer.Generate on a thread
(router/http/call.py: the same servicer, the same placement and limits, no extra hop) ->
router/http/responses.py -> JSON or SSE. A client that disconnects cancels its handler
(aiohttp's handler_cancellation), which cancels the downstream worker calls; their KV is freed.

aiohttp (which Ray already brings) runs on an event loop of its own, on a thread of its own; the
blocking servicer runs on a pool sized to the router's stream limit, so that limit, counted by
the servicer for both front doors, refuses extra streams (429) rather than the pool queueing them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from pdserve.engine.tokenizer import Tokenizer
from pdserve.security import SecurityConfig
from pdserve.security.auth import AUTHORIZATION_KEY, bearer_refusal, bearer_token, encoded_tokens
from router.http.call import CallAborted, HttpCallContext
from router.http.errors import ApiError
from router.http.protocol import ApiRequest, parse_chat, parse_completion
from router.http.responses import AnswerBuilder

log = logging.getLogger(__name__)

SPARE_THREADS = 8  # beyond the stream limit: refusals get a thread too, and answer at once
_END = object()  # the servicer's generator finished


@dataclass(frozen=True)
class ModelCard:
    """What GET /v1/models says about the one served model."""

    name: str
    max_model_len: int | None
    extension: Mapping[str, Any] = field(default_factory=dict)  # the "pdserve" object: sampling defaults
    architecture: str | None = None  # its family (pdserve/engine/families.py); None: not known here


class HttpFrontDoor:
    def __init__(self, servicer, tokenizer: Tokenizer, model: ModelCard, registry: CollectorRegistry,
                 live_decode_workers: Callable[[], int], security: SecurityConfig | None = None, *,
                 host: str = "127.0.0.1", port: int = 0, max_body_bytes: int = 4 << 20,
                 max_streams: int = 256) -> None:
        self.servicer, self.tokenizer, self.model, self.registry = servicer, tokenizer, model, registry
        self.live_decode_workers = live_decode_workers
        self.security = security or SecurityConfig()
        self._tokens = encoded_tokens(self.security.api_tokens) if self.security.api_tokens else []
        self.host, self.port, self.max_body_bytes = host, port, max_body_bytes
        self.started = int(time.time())
        self.executor = ThreadPoolExecutor(max_workers=max_streams + SPARE_THREADS,
                                           thread_name_prefix="http-generate")
        self.address = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        scheme = "https" if self._ssl_context() is not None else "http"
        return f"{scheme}://{self.address}" if self.address else ""

    # --- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> str:
        """Bind and serve; returns host:port. OSError names the port when it is taken."""
        ready: asyncio.Future = asyncio.Future(loop=(loop := asyncio.new_event_loop()))
        self._loop = loop
        self._thread = threading.Thread(target=self._serve, args=(ready,), name="http-api", daemon=True)
        self._thread.start()
        try:
            self.address = asyncio.run_coroutine_threadsafe(_result(ready), loop).result(timeout=30)
        except OSError as e:
            self.stop()
            raise OSError(f"router HTTP API: cannot bind {self.host}:{self.port} ({e}); choose another "
                          "--http-port, or 0 to turn HTTP off") from e
        return self.address

    def _serve(self, ready: asyncio.Future) -> None:
        loop = self._loop
        asyncio.set_event_loop(loop)
        loop.create_task(self._open(ready))
        loop.run_forever()

    async def _open(self, ready: asyncio.Future) -> None:
        try:
            runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, self.host, self.port, ssl_context=self._ssl_context())
            await site.start()
            self._runner = runner
            port = runner.addresses[0][1]
            ready.set_result(f"{self.host}:{port}")
        except Exception as e:  # noqa: BLE001 - handed to start(), which raises it
            ready.set_exception(e)

    def stop(self) -> None:
        loop = self._loop
        if loop is None:
            return
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), loop).result(timeout=10)
            self._runner = None
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=10)
        loop.close()
        self._loop = None
        self.executor.shutdown(wait=False, cancel_futures=True)

    def _ssl_context(self) -> ssl.SSLContext | None:
        tls = self.security.tls
        if tls is None or not tls.can_serve:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(tls.cert, tls.key)
        if tls.require_client_cert:
            context.verify_mode = ssl.CERT_REQUIRED
            context.load_verify_locations(tls.ca)
        return context

    # --- the app -------------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[self._errors, self._auth])
        app.add_routes([web.post("/v1/chat/completions", self._chat),
                        web.post("/v1/completions", self._completion),
                        web.get("/v1/models", self._models),
                        web.get("/v1/models/{model}", self._model),
                        web.get("/health", self._health),
                        web.get("/metrics", self._metrics)])
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            return await handler(request)
        except ApiError as e:
            return _error_response(e)
        except web.HTTPException as e:  # aiohttp's own: unknown path, wrong method, body too large
            if e.status < 400:
                raise
            kind = "not_found_error" if e.status == 404 else "invalid_request_error"
            message = (f"no route {request.method} {request.path}; see GET /v1/models" if e.status == 404
                       else f"{e.reason}: {e.text or ''}".strip(": "))
            return _error_response(ApiError(e.status, message, kind), e.headers)

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if self._tokens and request.path.startswith("/v1/"):
            refusal = bearer_refusal(request.headers.get("Authorization"), self._tokens,
                                     "send the header 'Authorization: Bearer <token>' (the openai SDK's "
                                     "api_key)")
            if refusal is not None:
                raise ApiError.unauthorized(refusal)
        return await handler(request)

    # --- endpoints ------------------------------------------------------------------------------------
    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_chat(await _json_body(request), self.model.name))

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_completion(await _json_body(request), self.model.name))

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_json()]})

    async def _model(self, request: web.Request) -> web.Response:
        if request.match_info["model"] != self.model.name:
            raise ApiError.model_not_found(request.match_info["model"], self.model.name)
        return web.json_response(self._model_json())

    def _model_json(self) -> dict:
        # OpenAI's four keys, then extra ones as vLLM adds root and max_model_len
        card = {"id": self.model.name, "object": "model", "created": self.started, "owned_by": "pdserve",
                "root": self.model.name, "max_model_len": self.model.max_model_len}
        if self.model.architecture is not None:
            card["architecture"] = self.model.architecture
        return card | {"pdserve": dict(self.model.extension)}

    async def _health(self, request: web.Request) -> web.Response:
        live = self.live_decode_workers()
        if not live:
            raise ApiError(503, "no live decode worker; is the cluster up (`pdserve status`)?",
                           "service_unavailable_error")
        return web.json_response({"status": "ok", "decode_workers": live})

    async def _metrics(self, request: web.Request) -> web.Response:
        body = await asyncio.get_running_loop().run_in_executor(None, generate_latest, self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    # --- generation ----------------------------------------------------------------------------------
    async def _generate(self, request: web.Request, api: ApiRequest) -> web.StreamResponse:
        header = request.headers.get("Authorization", "")
        context = HttpCallContext(bearer_token(((AUTHORIZATION_KEY, header),)))
        replies: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        loop.run_in_executor(self.executor, self._pump, api, context, replies, loop)
        try:
            first = await _next(replies)  # an error before the first reply is a plain error response
            builder = AnswerBuilder(api, self.tokenizer)
            if not api.stream:
                return await self._whole(builder, first, replies)
            return await self._stream(request, builder, first, replies)
        finally:
            context.cancel()  # a no-op once the call has ended; else (the client left) it frees the KV

    def _pump(self, api: ApiRequest, context: HttpCallContext, replies: asyncio.Queue,
              loop: asyncio.AbstractEventLoop) -> None:
        """On a pool thread: the servicer's replies, then _END or the error, onto the handler's queue."""
        put = lambda item: loop.call_soon_threadsafe(replies.put_nowait, item)
        try:
            for reply in self.servicer.Generate(api.generate, context):
                put(reply)
            put(_END)
        except CallAborted as e:
            put(ApiError.from_status(e.code, e.details, e.retry_after_s))
        except Exception as e:  # noqa: BLE001 - the handler answers 500; the router keeps serving
            log.exception("HTTP request failed inside the router")
            put(ApiError(500, f"the router failed on this request ({type(e).__name__}); see its log",
                         "server_error"))

    async def _whole(self, builder: AnswerBuilder, reply, replies: asyncio.Queue) -> web.Response:
        while reply is not _END:
            builder.add(reply)
            reply = await _next(replies)
        return web.json_response(builder.answer())

    async def _stream(self, request: web.Request, builder: AnswerBuilder, reply,
                      replies: asyncio.Queue) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        await response.prepare(request)
        for chunk in builder.opening_chunks():
            await _send(response, chunk)
        try:
            while reply is not _END:
                for chunk in builder.chunks(reply):
                    await _send(response, chunk)
                reply = await _next(replies)
        except ApiError as e:  # mid-stream: the status line is gone, so the error is an event
            await _send(response, e.body())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


async def _result(future: asyncio.Future):
    return await future


async def _next(replies: asyncio.Queue):
    item = await replies.get()
    if isinstance(item, ApiError):
        raise item
    return item


async def _send(response: web.StreamResponse, payload: dict) -> None:
    await response.write(b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n")


async def _json_body(request: web.Request) -> Any:
    try:
        return await request.json()
    except json.JSONDecodeError as e:
        message = f"the request body is not valid JSON ({e.msg} at character {e.pos})"
        raise ApiError.invalid(message, None) from e
    except UnicodeDecodeError as e:
        raise ApiError.invalid("the request body is not UTF-8 text", None) from e


def _error_response(e: ApiError, extra_headers: Mapping[str, str] | None = None) -> web.Response:
    headers = {**e.headers()}
    if extra_headers and "Allow" in extra_headers:
        headers["Allow"] = extra_headers["Allow"]
    return web.json_response(e.body(), status=e.status, headers=headers)
