"""The gRPC transport (--api grpc): pdserve.v1.Generation/Generate through AsyncPdserveClient.

--router takes several routers (a:1,b:2): the client spreads requests over them, retries one refused
before its first token on another and resumes a stream whose router died (pdserve/client.py). Each
router must answer at start. The router-side counters come from one router's /metrics, so with
several routers they are left out unless --metrics-url names where to read them.

A message with token_ids is a token message (it may carry several); the stream is OK when its
final message (finished=true) arrived, and that message carries usage, timings and workers. A
failure is the gRPC status name (PdserveError.code) with the router's message.
"""

from __future__ import annotations

import asyncio
from typing import Any

from loadtest.server_metrics import discover_metrics_url
from loadtest.transport import Clock, GenerationRequest, Reply, ReplyBuilder
from pdserve.client import TIMING_FIELDS, USAGE_FIELDS, AsyncPdserveClient, PdserveError
from pdserve.client_security import client_kwargs
from pdserve.router_targets import split_targets
from pdserve.security import SecurityConfig
from protos.pdserve.v1 import generation_pb2 as pb


class GrpcTransport:
    def __init__(self, router: str, timeout_s: float, security: SecurityConfig | None = None) -> None:
        self.target = router
        self.security = security or SecurityConfig()
        self._client = AsyncPdserveClient(router, timeout_s=timeout_s, **client_kwargs(self.security))

    async def __aenter__(self) -> GrpcTransport:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._client.close()

    async def check(self, timeout_s: float) -> None:
        await wait_for_router(self.target, timeout_s, self.security)

    async def metrics_url(self) -> str | None:
        if len(split_targets(self.target)) > 1:  # one router's counters would not be the run's
            return None
        return await asyncio.to_thread(discover_metrics_url, self.target, security=self.security)

    async def stream(self, request: GenerationRequest, clock: Clock) -> Reply:
        reply = ReplyBuilder(clock)
        final: pb.GenerateResponse | None = None
        reply.sent()
        try:
            async with self._client.stream(**client_fields(request)) as stream:
                async for response in stream:
                    if response.token_ids:
                        reply.tokens(len(response.token_ids))
                    reply.text(response.text)
                    if response.finished:
                        final = response
        except PdserveError as exc:
            return reply.failed(exc.code, exc.message)
        if final is None:
            return reply.failed("INTERNAL", "the stream ended without its final message (finished=true)")
        return reply.finished(**final_fields(final))


async def wait_for_router(target: str, timeout_s: float, security: SecurityConfig | None = None) -> None:
    """Raise ValueError (a user error) if a connection to each router in target (one, or several
    separated by commas) is not made within timeout_s."""
    for router in split_targets(target):
        async with (security or SecurityConfig()).open_channel(router, internal=False, aio=True) as channel:
            try:
                await asyncio.wait_for(channel.channel_ready(), timeout_s)
            except TimeoutError:
                raise ValueError(f"cannot reach the router at {router} within {timeout_s:g} s; "
                                 "is `pdserve up` running there?") from None


def client_fields(request: GenerationRequest) -> dict[str, Any]:
    """The AsyncPdserveClient.stream keywords for request."""
    prompt = ({"token_ids": list(request.token_ids)} if request.token_ids
              else {"messages": list(request.messages)})
    s = request.sampling
    return {**prompt, "request_id": request.request_id, "max_tokens": s.max_tokens,
            "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k, "seed": s.seed,
            "stop": list(s.stop) or None, "ignore_eos": s.ignore_eos, "routing": request.routing}


def final_fields(final: pb.GenerateResponse) -> dict[str, Any]:
    return {"usage": {k: getattr(final.usage, k) for k in USAGE_FIELDS},
            "server_timings_ms": {k: getattr(final.timings, k) for k in TIMING_FIELDS},
            "prefill_worker": final.prefill_worker or None, "decode_worker": final.decode_worker or None,
            "finish_reason": final.finish_reason}
