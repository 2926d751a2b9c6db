"""The KVTransfer service: a decode worker's end of KV transfers over gRPC (the prefill worker's
is prefill_worker/channels.py). Each Push is one transfer, handed to the KVReceiver; a failure
is the gRPC status its FailureKind names (pdserve/transfer/status.py). add_kv_transfer_service
registers it with the hand-written KVChunk parser (pdserve/transfer/kvchunk.py): the receiver
reads each frame's header and payload as views of gRPC's bytes, without a copy.

What the servicer allows one incoming push, before and while the receiver runs:

    peer cap      at most max_pushes_per_peer pushes at once from one peer host (the host of
                  context.peer(), so workers that share a host share the cap); one more is
                  refused RESOURCE_EXHAUSTED before a frame is read, so nothing is reserved
    time limit    BEGIN to END within time_limit_s, whatever deadline (or none) the sender
                  set. Lifecycle of the clock (_PushClock): RUNNING -> ENDED (END handed to
                  the receiver in time: the limit no longer applies) | EXPIRED (the limit
                  struck first: the servicer cancels the call, the receiver's next read
                  breaks, it fails the transfer as DEADLINE_EXCEEDED and frees the reservation)
                  NOTE: the sender sees CANCELLED (cancel is how a sync gRPC server ends a call
                  from another thread); the receiver's outcome and log say DEADLINE_EXCEEDED.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections import Counter
from collections.abc import Iterator
from urllib.parse import unquote

import grpc

from decode_worker.receiver import KVReceiver
from pdserve.kvwire import TransferEnd, WireError, decode_header
from pdserve.transfer.channel import Frame
from pdserve.transfer.errors import FailureKind, TransferFailed
from pdserve.transfer.kvchunk import PUSH_METHOD, parse_kv_chunk
from pdserve.transfer.status import status_of
from protos.pdserve.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc

log = logging.getLogger(__name__)

DEFAULT_MAX_PUSHES_PER_PEER = 64
DEFAULT_PUSH_TIME_LIMIT_S = 60.0

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
    """The limits are DecodeConfig's max_pushes_per_peer and push_time_limit_s (the messages name them)."""

    def __init__(self, receiver: KVReceiver, *, max_pushes_per_peer: int = DEFAULT_MAX_PUSHES_PER_PEER,
                 time_limit_s: float = DEFAULT_PUSH_TIME_LIMIT_S) -> None:
        if max_pushes_per_peer < 1:
            raise ValueError(f"max_pushes_per_peer must be >= 1, got {max_pushes_per_peer}")
        if not time_limit_s > 0:
            raise ValueError(f"push_time_limit_s must be > 0 seconds, got {time_limit_s}")
        self.receiver = receiver
        self.time_limit_s = time_limit_s
        self._peers = _PeerSlots(max_pushes_per_peer)

    def pushes_in_flight(self) -> dict[str, int]:
        """Peer host -> pushes from it in progress."""
        return self._peers.in_flight()

    @property
    def refused_over_peer_cap(self) -> int:
        """Pushes refused by the per-peer cap since start (they never reached the receiver)."""
        return self._peers.refused

    def Push(self, request_iterator, context):  # noqa: N802 (gRPC method name)
        peer = peer_host(context.peer())
        refusal = self._peers.take(peer)
        if refusal is not None:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
        clock = _PushClock(self.time_limit_s, context.cancel)
        try:
            report = self.receiver.receive(_frames_of(request_iterator, context, clock))
        except TransferFailed as e:
            if clock.expired:
                log.warning("KV push from %s cut at the time limit (push_time_limit_s = %g s): %s", peer,
                            self.time_limit_s, e.message)
            context.abort(status_of(e.kind), e.message)
        finally:
            clock.stop()
            self._peers.give_back(peer)
        return kv_transfer_pb2.PushReply(transfer_id=report.transfer_id,
                                         blocks_written=report.blocks_written,
                                         bytes_received=report.bytes_received)


def add_kv_transfer_service(servicer: KVTransferServicer, server: grpc.Server) -> None:
    """Serve `servicer` as /pdserve.v1.KVTransfer/Push, frames parsed by parse_kv_chunk."""
    service, _, method = PUSH_METHOD.strip("/").partition("/")
    handler = grpc.stream_unary_rpc_method_handler(
        servicer.Push, request_deserializer=parse_kv_chunk,
        response_serializer=kv_transfer_pb2.PushReply.SerializeToString)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(service, {method: handler})])


def peer_host(peer: str) -> str:
    """The host part of a gRPC peer string: 'ipv4:10.0.0.5:41234' -> '10.0.0.5',
    'ipv6:%5B::1%5D:41234' (gRPC percent-encodes the brackets) -> '::1'; any other form
    (unix:...) is kept whole."""
    scheme, _, rest = peer.partition(":")
    if scheme in ("ipv4", "ipv6") and ":" in rest:
        return unquote(rest).rpartition(":")[0].strip("[]")
    return peer


class _PeerSlots:
    """Pushes in progress per peer host, at most cap each."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self.refused = 0

    def take(self, peer: str) -> str | None:
        """Count one more push from peer; the refusal message when peer already has cap."""
        with self._lock:
            if self._counts[peer] >= self.cap:
                self.refused += 1
                return (f"{self._counts[peer]:,} KV pushes from {peer} are in progress; this worker's limit "
                        f"per peer is {self.cap:,} (max_pushes_per_peer); retry later")
            self._counts[peer] += 1
            return None

    def give_back(self, peer: str) -> None:
        with self._lock:
            self._counts[peer] -= 1
            if self._counts[peer] <= 0:
                del self._counts[peer]

    def in_flight(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class _ClockState(enum.Enum):
    RUNNING = "running"
    ENDED = "ended"
    EXPIRED = "expired"


class _PushClock:
    """The time limit of one incoming push (see the module docstring for its states)."""

    def __init__(self, limit_s: float, cancel_call) -> None:
        self.limit_s = limit_s
        self._cancel_call = cancel_call
        self._lock = threading.Lock()
        self._state = _ClockState.RUNNING
        self._timer = threading.Timer(limit_s, self._expire)
        self._timer.daemon = True
        self._timer.start()

    @property
    def expired(self) -> bool:
        with self._lock:
            return self._state is _ClockState.EXPIRED

    def end(self) -> bool:
        """END reached: stop the clock. False when the limit struck first (the call is cancelled)."""
        with self._lock:
            if self._state is _ClockState.EXPIRED:
                return False
            self._state = _ClockState.ENDED
        self._timer.cancel()
        return True

    def stop(self) -> None:
        self._timer.cancel()

    def _expire(self) -> None:
        with self._lock:
            if self._state is not _ClockState.RUNNING:
                return
            self._state = _ClockState.EXPIRED
        self._cancel_call()  # the receiver's blocked read breaks; it frees the reservation


def _frames_of(request_iterator, context, clock: _PushClock) -> Iterator[Frame]:
    try:
        for header, payload in request_iterator:
            # NOTE: only BEGIN and END have no payload, so a LAYER frame's header is decoded once
            # (by the receiver), not twice.
            if clock.expired or (not payload and _is_end(header) and not clock.end()):
                raise _StreamBroken(_over_time(clock), FailureKind.DEADLINE_EXCEEDED)
            yield header, payload
    except _StreamBroken:
        raise
    except Exception as e:
        reason = _over_time(clock) if clock.expired else f"{type(e).__name__}: {e}"
        raise _StreamBroken(reason, _why_broken(context, clock)) from e
    # The receiver stops reading at END, so we get here only when the stream ended early: the
    # sender half-closed, or gRPC ended the iterator of a call that was cancelled or ran out of
    # time (without raising, and sometimes before is_active() turns False).
    if not context.is_active() or _near_deadline(context) or clock.expired:
        raise _StreamBroken(_over_time(clock) if clock.expired else "the call ended before END",
                            _why_broken(context, clock))


def _is_end(header: bytes | memoryview) -> bool:
    try:
        return isinstance(decode_header(header), TransferEnd)
    except WireError:
        return False  # the receiver rejects it, with the reason


def _over_time(clock: _PushClock) -> str:
    return (f"the push did not reach END within this worker's time limit of {clock.limit_s:g} s "
            "(push_time_limit_s)")


def _near_deadline(context) -> bool:
    remaining = context.time_remaining()  # None: the sender set no deadline
    return remaining is not None and remaining <= DEADLINE_SLACK_S


def _why_broken(context, clock: _PushClock) -> FailureKind:
    if clock.expired or _near_deadline(context):
        return FailureKind.DEADLINE_EXCEEDED
    return FailureKind.CANCELLED
