"""FramePump (prefill_worker/frame_pump.py): order, the bound on frames ahead, and both ways to stop."""

import threading

import pytest

from pdserve.transfer.errors import FailureKind, TransferFailed
from pdserve.transfer.kvchunk import parse_kv_chunk
from prefill_worker.frame_pump import FramePump, PumpState


def frames(n):
    for i in range(n):
        yield f"h{i}".encode(), memoryview(bytes([i]) * 10)


def test_every_frame_arrives_in_order_and_no_more_than_ahead_wait():
    pump, pulled = FramePump(ahead=2), []

    def counted():
        for frame in frames(6):
            pulled.append(frame)
            yield frame

    filler = threading.Thread(target=pump.fill, args=(counted(), lambda: False, lambda: None))
    filler.start()
    filler.join(timeout=0.3)
    assert filler.is_alive() and len(pulled) == 3  # two queued, the third waits for room
    got = [tuple(map(bytes, parse_kv_chunk(m))) for m in pump.messages()]
    filler.join()
    assert got == [(f"h{i}".encode(), bytes([i]) * 10) for i in range(6)]
    assert pump.state is PumpState.DRAINED and pump.payload_bytes == 60


def test_frames_that_raise_cancel_the_call_and_end_the_stream():
    cancelled = []

    def failing():
        yield from frames(1)
        raise TransferFailed(FailureKind.ABORTED, "preempted")

    pump = FramePump()
    with pytest.raises(TransferFailed, match="preempted"):
        pump.fill(failing(), lambda: False, lambda: cancelled.append(True))
    assert cancelled == [True] and pump.state is PumpState.GAVE_UP
    assert len(list(pump.messages())) == 1  # the frame before the failure, then the end


def test_a_call_that_ended_stops_the_pump_at_the_next_frame():
    pump = FramePump(ahead=1)
    pump.fill(frames(5), lambda: True, lambda: None)
    assert pump.state is PumpState.CALL_ENDED and list(pump.messages()) == []
