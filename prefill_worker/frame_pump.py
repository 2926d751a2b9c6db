"""Frames made ahead of the wire: the sender thread gathers and serialises while gRPC sends.

gRPC Python pulls a request stream one message at a time, on its own thread, and pulls the
next only once the last is handed to the transport. Left to gRPC, every gather, checksum
and copy of a KV frame waits for the previous frame's send, and the other way round. A
FramePump runs the frames on the calling thread instead (the sender's thread, which would
otherwise only wait for the reply) and hands gRPC finished messages through a queue
holding at most `ahead`:

    sender thread:  fill(): frame -> serialize_kv_chunk -> [ queue, <= ahead ] ----.
    gRPC thread:    messages(): <-------------------------------------------------'  -> send

Lifecycle (PumpState): FILLING -> DRAINED (every frame queued, then the end of the stream)
| GAVE_UP (the frames raised: the call is cancelled, the error kept for the caller)
| CALL_ENDED (the call ended first: the receiver failed it or its deadline passed).

Why this keeps the sender's guarantees: the frames are pulled in the same order, with the
same abort checks between gathers (prefill_worker/sender.py); a frame's payload is serialised
before the next frame is pulled: on encode_layer's Python path it is a view of the gather's
staging buffer, copied into the message here; on its native path the frame is a PackedFrame,
its message made already (pdserve/kvwire.py). END is queued only after the frames have produced it.
"""

from __future__ import annotations

import enum
import queue
import threading
from collections.abc import Callable, Iterator

from pdserve.transfer.channel import Frame
from pdserve.transfer.kvchunk import serialize_kv_chunk

DEFAULT_FRAMES_AHEAD = 2
_POLL_S = 0.05  # how often a full queue looks whether the call has ended
_STOP = object()


class PumpState(enum.Enum):
    FILLING = "filling"
    DRAINED = "drained"
    GAVE_UP = "gave up"
    CALL_ENDED = "call ended"


class FramePump:
    def __init__(self, ahead: int = DEFAULT_FRAMES_AHEAD) -> None:
        if ahead < 1:
            raise ValueError(f"frames ahead must be >= 1, got {ahead}")
        self.state = PumpState.FILLING
        self.payload_bytes = 0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._free = threading.Semaphore(ahead)

    def messages(self) -> Iterator[bytes]:
        """The request stream for gRPC: serialised KVChunk messages until the pump stops."""
        while True:
            message = self._queue.get()
            if message is _STOP:
                return
            self._free.release()
            yield message

    def fill(self, frames: Iterator[Frame], call_done: Callable[[], bool],
             cancel: Callable[[], None]) -> None:
        """Serialise and queue every frame (blocking while `ahead` wait), then end the stream.
        Stops early when call_done() turns True. If the frames raise, cancels the call and
        re-raises, so the caller reports the frames' own error."""
        try:
            for frame in frames:
                message = serialize_kv_chunk(frame)
                if call_done() or not self._wait_for_room(call_done):
                    self.state = PumpState.CALL_ENDED
                    return
                self.payload_bytes += len(frame[1])
                self._queue.put(message)
            self.state = PumpState.DRAINED
        except BaseException:
            self.state = PumpState.GAVE_UP
            cancel()
            raise
        finally:
            self._queue.put(_STOP)

    def _wait_for_room(self, call_done: Callable[[], bool]) -> bool:
        while not self._free.acquire(timeout=_POLL_S):
            if call_done():
                return False
        return True
