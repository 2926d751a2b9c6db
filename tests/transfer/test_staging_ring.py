"""The staging ring and the CPU streams it is proven with (pdserve/transfer/staging.py,
pdserve/engine/device_streams.py): a slot is reused only once released and its copy's event has
completed; an aborted transfer's slots come back, in-flight ones once their copies finish; the ring
bounds host memory. Streams are held with threading.Event gates, never slept on.

The codec through the ring, and a whole transfer through it, are in test_staged_kv_path.py.
"""

from __future__ import annotations

import threading

import pytest
import torch

from pdserve.engine.device_streams import CpuStream, CpuStreams, CudaStreams, StreamError, streams_for
from pdserve.transfer.staging import SlotState, StagedCopies, StagingRing, StagingTimeout, staging_for_pool

FREE, HELD, DRAINING = SlotState.FREE, SlotState.HELD, SlotState.DRAINING
BRIEF_S = 0.05  # how long an acquire that must time out waits (its outcome does not depend on it)
LONG_S = 10.0  # how long a wait that must succeed may take at most


class Gate:
    """Holds a stream at the point it is submitted, until opened."""

    def __init__(self) -> None:
        self._open = threading.Event()

    def hold(self, stream) -> None:
        stream.submit(lambda: self._open.wait(LONG_S))

    def open(self) -> None:
        self._open.set()


@pytest.fixture
def streams():
    return CpuStreams()


@pytest.fixture
def stream():
    stream = CpuStream()
    yield stream
    stream.close()


def copy_event(streams, stream):
    event = streams.new_event()
    event.record(stream)
    return event


def test_a_cpu_stream_runs_its_work_in_order_and_an_event_completes_when_reached(streams, stream):
    gate, done = Gate(), []
    gate.hold(stream)
    stream.submit(lambda: done.append(1))
    event = copy_event(streams, stream)
    stream.submit(lambda: done.append(2))
    assert not event.query() and done == []
    gate.open()
    event.synchronize()
    assert event.query() and done[0] == 1
    copy_event(streams, stream).synchronize()
    assert done == [1, 2]


def test_wait_event_holds_a_streams_later_work_and_the_current_stream_runs_inline(streams, stream):
    other, gate, done = CpuStream(), Gate(), []
    try:
        gate.hold(other)
        stream.wait_event(copy_event(streams, other))
        stream.submit(lambda: done.append("after"))
        tail = copy_event(streams, stream)
        assert not tail.query()
        gate.open()
        tail.synchronize()
        assert done == ["after"]
    finally:
        other.close()
    compute = streams.current_stream()
    compute.submit(lambda: done.append("inline"))
    assert done[-1] == "inline" and copy_event(streams, compute).query()  # recorded already complete
    assert streams.new_event().query()  # never recorded: complete, as a CUDA event is


def test_an_error_on_a_stream_surfaces_on_the_next_event(streams, stream):
    stream.submit(lambda: 1 / 0)
    with pytest.raises(StreamError, match="ZeroDivisionError"):
        copy_event(streams, stream).synchronize()


def test_cuda_streams_construct_without_touching_cuda():
    cuda = streams_for("cuda")
    assert isinstance(cuda, CudaStreams) and isinstance(streams_for("cpu"), CpuStreams)
    assert staging_for_pool(torch.zeros(1, 2, 1, 1, 1, 1), slot_bytes=64) is None  # a CPU pool: none


def test_a_slot_is_not_handed_out_again_before_its_copy_event_completes(streams, stream):
    ring, gate = StagingRing(streams, num_slots=1, slot_bytes=64), Gate()
    first = ring.acquire("t1")
    gate.hold(stream)  # the copy out of the slot is still in flight
    ring.fence(first, copy_event(streams, stream))
    ring.release(first)
    assert ring.states() == [DRAINING], "released with its copy in flight, the slot must not be free"
    with pytest.raises(StagingTimeout, match="all 1 KV staging slots"):
        ring.acquire("t2", timeout_s=BRIEF_S)
    gate.open()
    second = ring.acquire("t2", timeout_s=LONG_S)
    assert second._slot is first._slot and ring.states() == [HELD]


def test_a_held_slot_stays_held_after_its_copy_completes(streams):
    ring = StagingRing(streams, num_slots=1, slot_bytes=64)
    held = ring.acquire("t1")
    ring.fence(held, copy_event(streams, streams.current_stream()))  # complete at once
    with pytest.raises(StagingTimeout):
        ring.acquire("t2", timeout_s=BRIEF_S)
    ring.release(held)
    assert ring.states() == [FREE]


def test_a_blocked_acquire_takes_the_slot_as_soon_as_it_is_released(streams):
    ring = StagingRing(streams, num_slots=1, slot_bytes=64)
    held, got = ring.acquire("t1"), []
    waiter = threading.Thread(target=lambda: got.append(ring.acquire("t2", timeout_s=LONG_S)))
    waiter.start()
    ring.release(held)
    waiter.join(LONG_S)
    assert [handle.owner for handle in got] == ["t2"]


def test_a_stale_handle_cannot_release_the_slots_next_holder(streams):
    ring = StagingRing(streams, num_slots=1, slot_bytes=64)
    old = ring.acquire("t1")
    assert ring.release_all("t1") == 1
    new = ring.acquire("t2", timeout_s=LONG_S)
    ring.release(old)  # the aborted transfer's own cleanup, late
    assert ring.states() == [HELD] and new.owner == "t2"


def test_an_abort_frees_its_idle_slots_at_once_and_in_flight_ones_when_their_copies_complete(streams, stream):
    ring, gate = StagingRing(streams, num_slots=3, slot_bytes=64), Gate()
    in_flight, idle, other = ring.acquire("t1"), ring.acquire("t1"), ring.acquire("t2")
    gate.hold(stream)
    ring.fence(in_flight, copy_event(streams, stream))
    ring.fence(idle, copy_event(streams, streams.current_stream()))
    assert ring.release_all("t1") == 2
    assert ring.states() == [DRAINING, FREE, HELD]
    assert ring.release_all("t1") == 0  # idempotent
    gate.open()
    copy_event(streams, stream).synchronize()
    assert ring.states() == [FREE, FREE, HELD]
    ring.release(other)


def test_the_context_manager_releases_on_an_exception(streams):
    ring = StagingRing(streams, num_slots=1, slot_bytes=64)
    with pytest.raises(RuntimeError, match="boom"), ring.slot("t1"):
        raise RuntimeError("boom")
    assert ring.states() == [FREE]


def test_the_ring_bounds_host_memory_to_its_slots(streams):
    ring = StagingRing(streams, num_slots=2, slot_bytes=1000)
    assert ring.allocated_bytes == 0  # a slot's buffer comes with its first use
    for transfer in range(20):
        with ring.slot(f"t{transfer}") as slot:
            slot.view(torch.float32, (250,)).fill_(transfer)
    assert ring.allocated_bytes == 1000  # one frame at a time: one slot was ever needed
    a, b = ring.acquire("a"), ring.acquire("b")
    assert ring.allocated_bytes == 2000
    with pytest.raises(StagingTimeout):
        ring.acquire("c", timeout_s=BRIEF_S)
    with pytest.raises(ValueError, match="a staging slot holds 1,000"):
        a.view(torch.float32, (251,))
    ring.release(a), ring.release(b)


def test_staged_copies_order_the_stream_after_compute_and_record_its_tail(streams):
    staged = StagedCopies.create(streams, slot_bytes=64, num_slots=2)
    try:
        gate, seen = Gate(), []
        gate.hold(staged.stream)
        staged.after_compute()  # compute is inline on the CPU: nothing more to wait for
        src, dst = torch.arange(4.0), torch.zeros(4)
        streams.copy(dst, src, staged.stream)
        staged.stream.submit(lambda: seen.append(dst.clone()))
        tail = staged.record()
        assert not tail.query() and dst.sum() == 0
        gate.open()
        tail.synchronize()
        assert torch.equal(seen[0], src)
    finally:
        staged.stream.close()
