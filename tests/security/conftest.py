"""TinyServer: real gRPC on a loopback port that records every call it serves (the dev CA: `dev_certs`
in tests/conftest.py)."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.security.tls import TLSConfig, add_port

SERVICE = "pdserve.test.Echo"
METHODS = {  # name -> (request_streaming, response_streaming)
    "Unary": (False, False),
    "Stream": (False, True),
    "Collect": (True, False),
    "Chat": (True, True),
}


def path(method: str) -> str:
    return f"/{SERVICE}/{method}"


class TinyServer:
    """Echo with all four call kinds plus grpc.health.v1, on 127.0.0.1; `calls` lists what ran."""

    def __init__(self, tls: TLSConfig | None = None, interceptors: Sequence[grpc.ServerInterceptor] = ()):
        self.calls: list[tuple[str, dict[str, str]]] = []
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), interceptors=list(interceptors))
        handlers = {
            "Unary": grpc.unary_unary_rpc_method_handler(self._unary),
            "Stream": grpc.unary_stream_rpc_method_handler(self._stream),
            "Collect": grpc.stream_unary_rpc_method_handler(self._collect),
            "Chat": grpc.stream_stream_rpc_method_handler(self._chat),
        }
        self._server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, handlers)])
        self.health = health.HealthServicer()
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        self.port = add_port(self._server, "127.0.0.1:0", tls)
        assert self.port != 0
        self._server.start()

    @property
    def called(self) -> list[str]:
        return [name for name, _ in self.calls]

    def _record(self, name: str, context: grpc.ServicerContext) -> None:
        with self._lock:
            self.calls.append((name, dict(context.invocation_metadata())))

    def _unary(self, request: bytes, context) -> bytes:
        self._record("Unary", context)
        return b"echo:" + request

    def _stream(self, request: bytes, context) -> Iterator[bytes]:
        self._record("Stream", context)
        for i in range(3):
            yield request + str(i).encode()

    def _collect(self, requests: Iterator[bytes], context) -> bytes:
        self._record("Collect", context)
        return b"+".join(requests)

    def _chat(self, requests: Iterator[bytes], context) -> Iterator[bytes]:
        self._record("Chat", context)
        for request in requests:
            yield b"echo:" + request

    def stop(self) -> None:
        self._server.stop(0).wait()


def call(channel: grpc.Channel, method: str, timeout: float = 5.0, **kwargs) -> list[bytes]:
    """Call method on the Echo service with b'a', b'b'; returns the responses as a list."""
    requests = [b"a", b"b"]
    request_streaming, response_streaming = METHODS[method]
    kind = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
            (True, False): channel.stream_unary, (True, True): channel.stream_stream}
    stub = kind[(request_streaming, response_streaming)](path(method))
    result = stub(iter(requests) if request_streaming else requests[0], timeout=timeout, **kwargs)
    return list(result) if response_streaming else [result]


def health_check(channel: grpc.Channel) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status


@pytest.fixture
def tiny_server_factory():
    servers: list[TinyServer] = []

    def make(tls: TLSConfig | None = None, interceptors: Sequence[grpc.ServerInterceptor] = ()) -> TinyServer:
        server = TinyServer(tls, interceptors)
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()
