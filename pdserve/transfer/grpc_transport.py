"""KV transfer over a real gRPC socket: the KVTransfer servicer and a client channel.

Both ends set the message size limits explicitly, far above the codec's chunk size
(frames are at most max_chunk_bytes of payload plus a small header). Failures map
one to one between FailureKind and gRPC status codes in both directions, except that
a sender which gives up itself (its frames raise TransferFailed) reports its own kind:
gRPC would only say UNKNOWN "Exception iterating requests!".

The client channel dials as an internal client of the given SecurityConfig (TLS and the
cluster secret). A decode worker that refuses the secret fails the push as INTERNAL (no
FailureKind is "unauthenticated"), with the receiver's message saying why.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from pdserve.security import SecurityConfig
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

# NOTE: when a push runs out of time, the client's deadline fires first: it cancels the call,
# and the cancel reaches the receiver while the receiver's copy of the deadline (sent as a
# relative timeout, so later by the one-way latency) still has a few ms left. A stream that
# breaks this close to its deadline broke because of the deadline.
DEADLINE_SLACK_S = 0.25


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
        raise _StreamBroken(f"{type(e).__name__}: {e}", _why_broken(context)) from e
    # The receiver stops reading at END, so we get here only when the stream ended early: the
    # sender half-closed, or gRPC ended the iterator of a call that was cancelled or ran out of
    # time (without raising, and sometimes before is_active() turns False).
    if not context.is_active() or _near_deadline(context):
        raise _StreamBroken("the call ended before END", _why_broken(context))


def _near_deadline(context) -> bool:
    remaining = context.time_remaining()  # None: the sender set no deadline
    return remaining is not None and remaining <= DEADLINE_SLACK_S


def _why_broken(context) -> FailureKind:
    return FailureKind.DEADLINE_EXCEEDED if _near_deadline(context) else FailureKind.CANCELLED


class GrpcKVChannel:
    """Client end: pushes one transfer's frames per call over a shared gRPC channel."""

    def __init__(self, target: str, security: SecurityConfig | None = None) -> None:
        self.target = target
        self._channel = (security or SecurityConfig()).open_channel(target, GRPC_OPTIONS, internal=True)
        self._stub = kv_transfer_pb2_grpc.KVTransferStub(self._channel)

    def push(self, frames: Iterator[Frame], timeout_s: float) -> PushResult:
        sent = 0
        gave_up: TransferFailed | None = None

        def chunks():
            nonlocal sent, gave_up
            try:
                for header, payload in frames:
                    sent += len(payload)
                    yield kv_transfer_pb2.KVChunk(header=header, payload=payload)
            except TransferFailed as e:  # recorded before gRPC cancels the call with it
                gave_up = e
                raise

        try:
            reply = self._stub.Push(chunks(), timeout=timeout_s)
        except grpc.RpcError as e:
            if gave_up is not None:
                raise gave_up from e
            kind = _FROM_STATUS.get(e.code(), FailureKind.INTERNAL)
            raise TransferFailed(kind, e.details() or str(e.code())) from e
        return PushResult(reply.transfer_id, reply.blocks_written, sent)

    def close(self) -> None:
        self._channel.close()
