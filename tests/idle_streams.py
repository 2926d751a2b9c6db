"""Many idle streaming calls from real gRPC clients: opened, then silent until closed.

Each call is opened on one of a few real channels (grpc.aio, one event loop on a thread of its
own, so hundreds of calls cost no thread each). A call the server refuses ends at once; its
status is recorded. The others stay open, sending nothing, until close().
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

OpenCall = Callable[[grpc.aio.Channel], grpc.aio.Call]


@dataclass(frozen=True)
class Ended:
    code: grpc.StatusCode
    details: str


class IdleStreams:
    def __init__(self, address: str, open_call: OpenCall, count: int, channels: int = 8) -> None:
        self.address, self.open_call, self.count, self.num_channels = address, open_call, count, channels
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="idle-streams", daemon=True)
        self._lock = threading.Lock()
        self._ended: list[Ended] = []
        self._calls: list[grpc.aio.Call] = []
        self._watchers: list[asyncio.Future] = []
        self._channels: list[grpc.aio.Channel] = []

    def __enter__(self) -> IdleStreams:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._open(), self._loop).result(timeout=30)
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    async def _open(self) -> None:
        self._channels = [grpc.aio.insecure_channel(self.address) for _ in range(self.num_channels)]
        for i in range(self.count):
            call = self.open_call(self._channels[i % self.num_channels])
            self._calls.append(call)
            self._watchers.append(asyncio.ensure_future(self._record_end(call)))

    async def _record_end(self, call: grpc.aio.Call) -> None:
        code = await call.code()
        details = await call.details()
        with self._lock:
            self._ended.append(Ended(code, details or ""))

    def ended(self) -> list[Ended]:
        with self._lock:
            return list(self._ended)

    def wait_ended(self, count: int, timeout_s: float) -> list[Ended]:
        """The calls that have ended, once at least count have (or timeout_s has passed)."""
        deadline = time.monotonic() + timeout_s
        while len(self.ended()) < count and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.ended()

    def close(self) -> None:
        if not self._thread.is_alive():
            return

        async def shut() -> None:
            for call in self._calls:
                call.cancel()
            await asyncio.gather(*self._watchers)
            for channel in self._channels:
                await channel.close()

        asyncio.run_coroutine_threadsafe(shut(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()
