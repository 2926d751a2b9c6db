"""The OpenAI HTTP transport (--api openai): streamed chat and completions over aiohttp.

    base URL  http://HOST:PORT (a trailing /v1, as the openai SDK's base_url has it, is dropped)
    check     GET /v1/models until it answers 200 (or the connect timeout); the model is --model,
              or else the first id listed
    metrics   BASE/metrics (pdserve's HTTP API serves the router's registry there; vLLM does too)
    stream    POST (openai_protocol.request_body), then the SSE body read as the bytes arrive:
              every event completed by one network read is timed at that read

Bearer token: security.api_tokens[0] (--api-token-file / --api-token-env) goes in the
Authorization header. An https:// URL is dialled trusting --tls-ca (else the system's CAs), with
--tls-client-cert/--tls-client-key shown to a server that asks for one.

NOTE: one aiohttp session with no connection limit (aiohttp's default pools 100), so an open
loop at a high rate never waits for a free connection inside this process, which would add to
every TTFT; connections are kept alive and reused between requests.
"""

from __future__ import annotations

import asyncio
import ssl
import time

import aiohttp

from loadtest.openai_protocol import (
    CONNECTION_ERROR,
    MODELS_PATH,
    TIMEOUT,
    StreamReader,
    error_status,
    model_ids,
    request_body,
)
from loadtest.sse import SSEDecoder
from loadtest.transport import Clock, GenerationRequest, Reply, ReplyBuilder
from pdserve.security import SecurityConfig

RETRY_S = 0.2


class OpenAITransport:
    def __init__(self, url: str, timeout_s: float, security: SecurityConfig | None = None,
                 model: str | None = None) -> None:
        self.target = base_url(url)
        self.timeout_s = timeout_s
        self.model = model
        security = security or SecurityConfig()
        self._headers = {"Authorization": f"Bearer {security.api_tokens[0]}"} if security.api_tokens else {}
        self._ssl = ssl_context(security, self.target)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> OpenAITransport:
        connector = aiohttp.TCPConnector(limit=0, ssl=self._ssl if self._ssl is not None else True)
        self._session = aiohttp.ClientSession(connector=connector, headers=self._headers,
                                              timeout=aiohttp.ClientTimeout(total=None))
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("OpenAITransport is used outside its `async with` block")
        return self._session

    async def check(self, timeout_s: float) -> None:
        """GET /v1/models until it answers; pick (or check) the model. ValueError says what is wrong."""
        url = self.target + MODELS_PATH
        deadline = time.monotonic() + timeout_s
        last = "no answer"
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ValueError(f"cannot reach the HTTP API at {self.target} within {timeout_s:g} s "
                                 f"({last}); is `pdserve up --http-port` running there?")
            try:
                async with asyncio.timeout(left):
                    async with self.session.get(url) as response:
                        if response.status == 200:
                            self._choose_model(model_ids(await response.json(content_type=None)))
                            return
                        _, message = error_status(response.status, await response.text())
                        raise ValueError(_refusal(url, response.status, message))
            except (aiohttp.ClientConnectionError, TimeoutError) as exc:
                last = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            await asyncio.sleep(min(RETRY_S, max(0.0, deadline - time.monotonic())))

    def _choose_model(self, ids: list[str]) -> None:
        if self.model is None:
            if not ids:
                raise ValueError(f"GET {self.target}{MODELS_PATH} lists no model; give --model NAME")
            self.model = ids[0]
        elif self.model not in ids:
            raise ValueError(f"the server at {self.target} does not serve model {self.model!r}; it lists "
                             f"{', '.join(ids) or 'none'} (--model)")

    async def metrics_url(self) -> str | None:
        return self.target + "/metrics"

    async def stream(self, request: GenerationRequest, clock: Clock) -> Reply:
        if self.model is None:
            raise RuntimeError("OpenAITransport.stream before check(): the model is not known yet")
        path, body = request_body(request, self.model)
        reply = ReplyBuilder(clock)
        reader = StreamReader(reply)
        reply.sent()
        try:
            async with asyncio.timeout(self.timeout_s):
                async with self.session.post(self.target + path, json=body) as response:
                    if response.status != 200:
                        text = await response.text(errors="replace")
                        return reply.failed(*error_status(response.status, text,
                                                          response.headers.get("Retry-After")))
                    decoder = SSEDecoder()
                    async for data in response.content.iter_any():
                        at = clock()
                        for event in decoder.feed(data):
                            reader.event(event, at)
                    for event in decoder.close():
                        reader.event(event, clock())
        except TimeoutError:
            return reply.failed(TIMEOUT, f"the stream did not end within {self.timeout_s:g} s (--timeout)")
        except aiohttp.ClientError as exc:
            return reply.failed(CONNECTION_ERROR, f"{type(exc).__name__}: {exc}")
        return reader.result()


def base_url(url: str) -> str:
    """The server's root: http://HOST:PORT, whether or not url ends in / or /v1."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--url must start with http:// or https://, got {url!r}")
    url = url.rstrip("/")
    return url.removesuffix("/v1")


def ssl_context(security: SecurityConfig, url: str) -> ssl.SSLContext | None:
    """How to dial an https:// URL; None for http:// (where TLS flags are a mistake)."""
    tls = security.tls
    if not url.startswith("https://"):
        if tls is not None or security.client_cert is not None:
            raise ValueError(f"--tls-ca / --tls-client-cert need an https:// --url, got {url}")
        return None
    context = ssl.create_default_context(cafile=tls.ca if tls is not None else None)
    if security.client_cert is not None:
        context.load_cert_chain(security.client_cert, security.client_key)
    return context


def _refusal(url: str, status: int, message: str) -> str:
    if status == 401:
        return (f"GET {url} was refused (401 {message}); give the API token with --api-token-file FILE "
                "or --api-token-env NAME")
    return f"GET {url} answered {status}: {message}"
