"""A prefill worker's channels to decode workers: one gRPC channel per decode worker address,
each carrying one KVTransfer.Push per transfer.

GrpcKVChannel dials as an internal client of the worker's SecurityConfig (TLS and the cluster
secret), with the keepalive of its ConnectionPolicy (pdserve/grpc_options.py), and message
limits far above the codec's chunk size. Frames go out as KVChunk messages written by hand
(pdserve/transfer/kvchunk.py: one copy of the payload, not the generated class's three), made
on the caller's thread a few ahead of gRPC's sends (frame_pump.py). A failure is the
FailureKind its status names (pdserve/transfer/status.py), except that a sender which gives
up itself (its frames raise TransferFailed) reports its own kind, and the call is cancelled.
A decode worker that refuses the secret fails the push as INTERNAL, with its message saying
why.

DecodeChannels keeps at most MAX_DECODE_CHANNELS of them, least recently used closed first,
each wrapped in the worker's FaultInjectingChannel when it has a fault plan (faults.py).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator

import grpc

from pdserve.grpc_options import ConnectionPolicy, channel_options
from pdserve.security import SecurityConfig
from pdserve.transfer.channel import Frame, KVChannel, PushResult
from pdserve.transfer.errors import FailureKind, TransferFailed
from pdserve.transfer.kvchunk import PUSH_METHOD
from pdserve.transfer.status import failure_of
from prefill_worker.faults import FaultInjector
from prefill_worker.frame_pump import DEFAULT_FRAMES_AHEAD, FramePump
from protos.pdserve.v1 import kv_transfer_pb2

# NOTE: one channel per decode worker address. A decode worker that restarts comes back on a new
# port, so without a bound this would grow by one channel per restart for the life of the process.
MAX_DECODE_CHANNELS = 64


class GrpcKVChannel:
    """Client end: pushes one transfer's frames per call over a shared gRPC channel."""

    def __init__(self, target: str, security: SecurityConfig | None = None,
                 connections: ConnectionPolicy | None = None,
                 frames_ahead: int = DEFAULT_FRAMES_AHEAD) -> None:
        self.target, self.frames_ahead = target, frames_ahead
        self._channel = (security or SecurityConfig()).open_channel(target, channel_options(connections),
                                                                    internal=True)
        # NOTE: no request_serializer: the pump hands gRPC messages it has serialised already.
        self._push = self._channel.stream_unary(PUSH_METHOD,
                                                response_deserializer=kv_transfer_pb2.PushReply.FromString)

    def push(self, frames: Iterator[Frame], timeout_s: float) -> PushResult:
        """Send the frames from this thread, `frames_ahead` at most queued (frame_pump.py)."""
        pump = FramePump(self.frames_ahead)
        call = self._push.future(pump.messages(), timeout=timeout_s)
        try:
            pump.fill(frames, call.done, call.cancel)
        except TransferFailed:  # the sender gave up: its own kind, not gRPC's CANCELLED
            raise
        except Exception as e:
            raise TransferFailed(FailureKind.INTERNAL, f"KV frames failed: {type(e).__name__}: {e}") from e
        try:
            reply = call.result()
        except grpc.RpcError as e:
            raise TransferFailed(failure_of(e.code()), e.details() or str(e.code())) from e
        return PushResult(reply.transfer_id, reply.blocks_written, pump.payload_bytes)

    def close(self) -> None:
        self._channel.close()


class DecodeChannels:
    """The KV channel to each decode worker address this worker pushes to."""

    def __init__(self, dial: Callable[[str], KVChannel], faults: FaultInjector | None = None) -> None:
        self._dial, self._faults = dial, faults
        self._channels: OrderedDict[str, KVChannel] = OrderedDict()
        self._lock = threading.Lock()

    def __call__(self, target: str) -> KVChannel:
        """The channel to target; past MAX_DECODE_CHANNELS the least recently used is closed (its
        peer is most likely a decode worker that restarted on another port)."""
        evicted = []
        with self._lock:
            if target in self._channels:
                self._channels.move_to_end(target)
            else:
                channel = self._dial(target)
                self._channels[target] = channel if self._faults is None else self._faults.wrap(channel)
                while len(self._channels) > MAX_DECODE_CHANNELS:
                    evicted.append(self._channels.popitem(last=False)[1])
            channel = self._channels[target]
        for old in evicted:
            _close(old)
        return channel

    def addresses(self) -> list[str]:
        """Addresses with an open channel, least recently used first."""
        with self._lock:
            return list(self._channels)

    def close(self) -> None:
        with self._lock:
            channels, self._channels = list(self._channels.values()), OrderedDict()
        for channel in channels:
            _close(channel)


def _close(channel: KVChannel) -> None:
    close = getattr(channel, "close", None)  # an in-process channel holds nothing to close
    if close is not None:
        close()
