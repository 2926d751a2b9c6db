"""Real gRPC clients that misbehave on purpose, for the limit and connection tests.

    IdleStreams     many streaming calls opened on a few real channels (grpc.aio, one event loop
                    on a thread of its own, so hundreds of calls cost no thread each); a call the
                    server refuses ends at once and its status is recorded, the others stay open,
                    sending nothing, until close()
    HeldPush        a KV push that sends some frames and then nothing, with no deadline unless
                    given, until release()
    seconds_until_idle_after_a_call   how long a server keeps an idle connection open
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.pdserve.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc, worker_pb2, worker_pb2_grpc

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


class HeldPush:
    def __init__(self, target: str, frames: Sequence[tuple[bytes, bytes]] = (),
                 timeout_s: float | None = None) -> None:
        self._release = threading.Event()
        self._channel = grpc.insecure_channel(target)
        self.started = time.monotonic()
        self.ended_after_s: float | None = None  # from the start to the end of the call

        def chunks() -> Iterator[kv_transfer_pb2.KVChunk]:
            for header, payload in frames:
                yield kv_transfer_pb2.KVChunk(header=header, payload=payload)
            self._release.wait()

        stub = kv_transfer_pb2_grpc.KVTransferStub(self._channel)
        self.future = stub.Push.future(chunks(), timeout=timeout_s)
        self.future.add_done_callback(self._ended)

    def _ended(self, _future) -> None:
        self.ended_after_s = time.monotonic() - self.started

    def release(self) -> grpc.StatusCode:
        """End the stream (the sender half-closes); the code the push ended with."""
        self._release.set()
        return self.code()

    def code(self, timeout_s: float = 30.0) -> grpc.StatusCode:
        self.future.exception(timeout=timeout_s)
        return self.future.code()

    def close(self) -> None:
        self._release.set()
        self._channel.close()


def seconds_until_idle_after_a_call(address: str, timeout_s: float = 5.0) -> float | None:
    """Make one call on a fresh channel, then wait for the server to close the connection (the
    channel goes from READY to IDLE on the server's GOAWAY); None when it is still open."""
    went_idle = threading.Event()

    def watch(state: grpc.ChannelConnectivity) -> None:
        if state is grpc.ChannelConnectivity.IDLE:
            went_idle.set()

    with grpc.insecure_channel(address) as channel:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        called = time.monotonic()
        channel.subscribe(watch, try_to_connect=False)
        closed = went_idle.wait(timeout_s)
        channel.unsubscribe(watch)
    return time.monotonic() - called if closed else None


class HeldPrefill:
    """A Prefill call held open on a prefill worker: its decode target is a socket that takes TCP
    connections and never speaks HTTP/2, so the KV push, and the call, wait until close()."""

    def __init__(self, target: str, prompt: Sequence[int]) -> None:
        self._black_hole = socket.create_server(("127.0.0.1", 0))
        self._channel = grpc.insecure_channel(target)
        request = worker_pb2.PrefillRequest(
            request_id=f"held-{uuid.uuid4().hex[:8]}", prompt_token_ids=list(prompt),
            decode_target=f"127.0.0.1:{self._black_hole.getsockname()[1]}")
        request.sampling.max_tokens = 1
        self.future = worker_pb2_grpc.PrefillServiceStub(self._channel).Prefill.future(request, timeout=120)

    def close(self) -> None:
        self.future.cancel()
        self._channel.close()
        self._black_hole.close()
