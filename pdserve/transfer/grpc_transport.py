"""KV transfer over a real gRPC socket: the KVTransfer servicer and a client channel.

Both ends set the message size limits explicitly, far above the codec's chunk size
(frames are at most max_chunk_bytes of payload plus a small header). Failures map
one to one between FailureKind and gRPC status codes in both directions.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures

import grpc

from pdserve.transfer.errors import FailureKind, TransferFailed
from pdserve.transfer.receiver import KVReceiver
from pdserve.transfer.sender import Frame, PushResult
from protos.pdserve.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc

MAX_MESSAGE_BYTES = 64 << 20
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]

_TO_STATUS = {kind: getattr(grpc.StatusCode, kind.value) for kind in FailureKind}
_FROM_STATUS = {status: kind for kind, status in _TO_STATUS.items()}


class _StreamBroken(Exception):
    """The client's stream ended abnormally (disconnect, deadline, cancel)."""

    def __init__(self, message: str, failure_kind: FailureKind) -> None:
        super().__init__(message)
        self.failure_kind = failure_kind


class KVTransferServicer(kv_transfer_pb2_grpc.KVTransferServicer):
    def __init__(self, receiver: KVReceiver) -> None:
        self.receiver = receiver

    def Push(self, request_iterator, context):  # noqa: N802 (gRPC method name)
        try:
            report = self.receiver.receive(_frames_of(request_iterator, context))
        except TransferFailed as e:
            context.abort(_TO_STATUS[e.kind], e.message)
        return kv_transfer_pb2.PushReply(transfer_id=report.transfer_id,
                                         blocks_written=report.blocks_written,
                                         bytes_received=report.bytes_received)


def _frames_of(request_iterator, context) -> Iterator[Frame]:
    try:
        for chunk in request_iterator:
            yield chunk.header, chunk.payload
    except Exception as e:
        deadline_passed = (context.time_remaining() or 0) <= 0
        kind = FailureKind.DEADLINE_EXCEEDED if deadline_passed else FailureKind.CANCELLED
        raise _StreamBroken(f"{type(e).__name__}: {e}", kind) from e
    if not context.is_active():
        raise _StreamBroken("the call is no longer active", FailureKind.CANCELLED)


def serve_kv_transfer(receiver: KVReceiver, host: str = "127.0.0.1", port: int = 0,
                      max_workers: int = 8) -> tuple[grpc.Server, int]:
    """Start a gRPC server with the KVTransfer service; returns (server, bound port)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=GRPC_OPTIONS)
    kv_transfer_pb2_grpc.add_KVTransferServicer_to_server(KVTransferServicer(receiver), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"could not bind the KV transfer server to {host}:{port}")
    server.start()
    return server, bound


class GrpcKVChannel:
    """Client end: pushes one transfer's frames per call over a shared gRPC channel."""

    def __init__(self, target: str) -> None:
        self.target = target
        self._channel = grpc.insecure_channel(target, options=GRPC_OPTIONS)
        self._stub = kv_transfer_pb2_grpc.KVTransferStub(self._channel)

    def push(self, frames: Iterator[Frame], timeout_s: float) -> PushResult:
        sent = 0

        def chunks():
            nonlocal sent
            for header, payload in frames:
                sent += len(payload)
                yield kv_transfer_pb2.KVChunk(header=header, payload=payload)

        try:
            reply = self._stub.Push(chunks(), timeout=timeout_s)
        except grpc.RpcError as e:
            kind = _FROM_STATUS.get(e.code(), FailureKind.INTERNAL)
            raise TransferFailed(kind, e.details() or str(e.code())) from e
        return PushResult(reply.transfer_id, reply.blocks_written, sent)

    def close(self) -> None:
        self._channel.close()
