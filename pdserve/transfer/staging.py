"""Host staging for a device KV pool: a ring of page-locked slots that KV frames pass through.

On a device pool a frame's blocks cannot be hashed or sent from device memory, nor written there from
gRPC's bytes, without a copy through host memory; a copy from or to pageable memory holds the host
until it is done. So each frame goes through one slot of a fixed ring (pinned on CUDA):

    send     gather on the device -> D2H into a slot (transfer stream) -> event -> hash, send -> release
    receive  verified payload -> slot -> H2D and index_copy_ into the pool (load stream) -> event -> release

Lifecycle of a slot (SlotState):

    FREE --acquire(owner)--> HELD --release / release_all(owner)--> DRAINING --its event completes--> FREE
                              |                                                  ^
                              '-- fence(event): the last copy into or out of it -'

A slot is handed out again only once its holder released it AND the event of its last copy has
completed, so no copy still in flight ever reads or writes a slot that someone else holds. An aborted
transfer's slots (release_all) follow the same path: free at once when idle, once their copy
completes otherwise. acquire blocks while every slot is HELD or DRAINING and raises StagingTimeout
after timeout_s. The ring holds at most num_slots x slot_bytes of host memory (a slot's buffer is
allocated on its first use and kept).

StagedCopies pairs a ring with the stream its copies are ordered on; pdserve/kvwire.py takes one
(encode_layer, receive_layer), and staging_for_pool gives a device pool its own (None on the CPU,
whose pool path stays pdserve's native kv_blocks kernels).
"""

from __future__ import annotations

import enum
import math
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

import torch

from pdserve.engine.device_streams import DeviceStreams, Event, Stream, streams_for

DEFAULT_STAGING_SLOTS = 8
DEFAULT_ACQUIRE_TIMEOUT_S = 30.0
# NOTE: a CUDA event has no completion callback, so a waiting acquire looks again this often
# (a release wakes it at once).
_POLL_S = 0.001


class StagingTimeout(TimeoutError):
    """Every staging slot stayed busy for the whole acquire timeout."""


class SlotState(enum.Enum):
    FREE = "free"
    HELD = "held"
    DRAINING = "draining"  # released, its last copy possibly still in flight


@dataclass(eq=False)
class _Slot:
    index: int
    buffer: torch.Tensor | None = None
    state: SlotState = SlotState.FREE
    owner: str | None = None
    lease: int = 0  # counts acquires, so a stale handle cannot release the slot's next holder
    last_copy: Event | None = None


@dataclass(frozen=True, eq=False)
class StagingSlot:
    """One holder's handle on a slot; release it through its ring (or use StagingRing.slot)."""

    _slot: _Slot
    owner: str
    lease: int

    @property
    def nbytes(self) -> int:
        assert self._slot.buffer is not None
        return self._slot.buffer.numel()

    def view(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The slot's first bytes as a contiguous tensor of that dtype and shape."""
        assert self._slot.buffer is not None
        nbytes = dtype.itemsize * math.prod(shape)
        if nbytes > self.nbytes:
            raise ValueError(f"{list(shape)} {dtype} needs {nbytes:,} bytes; "
                             f"a staging slot holds {self.nbytes:,}")
        return self._slot.buffer[:nbytes].view(dtype).view(shape)


class StagingRing:
    """num_slots host buffers of slot_bytes each; safe to use from many threads."""

    def __init__(self, streams: DeviceStreams, num_slots: int = DEFAULT_STAGING_SLOTS,
                 slot_bytes: int = 4 << 20) -> None:
        if num_slots < 1 or slot_bytes < 1:
            raise ValueError(f"a staging ring needs >= 1 slot of >= 1 byte, got {num_slots} x {slot_bytes}")
        self.streams, self.slot_bytes = streams, slot_bytes
        self._slots = [_Slot(i) for i in range(num_slots)]
        self._changed = threading.Condition()

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    @property
    def allocated_bytes(self) -> int:
        """Host memory the ring holds now (at most num_slots x slot_bytes)."""
        return sum(s.buffer.numel() for s in self._slots if s.buffer is not None)

    def states(self) -> list[SlotState]:
        with self._changed:
            self._reclaim()
            return [s.state for s in self._slots]

    def acquire(self, owner: str, timeout_s: float = DEFAULT_ACQUIRE_TIMEOUT_S) -> StagingSlot:
        """A FREE slot for owner; blocks while none is, StagingTimeout after timeout_s."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while (slot := self._free_slot()) is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise StagingTimeout(self._busy_message(timeout_s))
                self._changed.wait(min(remaining, _POLL_S))
            return self._hand_out(slot, owner)

    def fence(self, handle: StagingSlot, last_copy: Event) -> None:
        """last_copy is the event of the latest copy into or out of the slot (recorded already)."""
        with self._changed:
            if self._holds(handle):
                handle._slot.last_copy = last_copy

    def release(self, handle: StagingSlot) -> None:
        """The holder is done with the slot; it is FREE again once its last copy completes.
        A handle already released (release_all included) is a no-op."""
        with self._changed:
            if self._holds(handle):
                self._drain(handle._slot)

    def release_all(self, owner: str) -> int:
        """Release every slot owner holds (an aborted transfer); returns how many it held.
        NOTE: call it on the holder's own thread (the sender's does, as its stream ends): a slot released
        between a copy's submit and its fence could be handed out before that copy ran."""
        with self._changed:
            held = [s for s in self._slots if s.state is SlotState.HELD and s.owner == owner]
            for slot in held:
                self._drain(slot)
            return len(held)

    @contextmanager
    def slot(self, owner: str, timeout_s: float = DEFAULT_ACQUIRE_TIMEOUT_S) -> Iterator[StagingSlot]:
        """acquire, and release on leaving the block (a generator closed early included)."""
        handle = self.acquire(owner, timeout_s)
        try:
            yield handle
        finally:
            self.release(handle)

    # --- internals (the condition's lock held) --------------------------------------------------------
    def _free_slot(self) -> _Slot | None:
        self._reclaim()
        return next((s for s in self._slots if s.state is SlotState.FREE), None)

    def _reclaim(self) -> None:
        for slot in self._slots:
            if slot.state is SlotState.DRAINING and (slot.last_copy is None or slot.last_copy.query()):
                slot.state, slot.last_copy = SlotState.FREE, None

    def _hand_out(self, slot: _Slot, owner: str) -> StagingSlot:
        if slot.buffer is None:
            slot.buffer = self.streams.pinned_empty((self.slot_bytes,), torch.uint8)
        slot.state, slot.owner, slot.lease = SlotState.HELD, owner, slot.lease + 1
        return StagingSlot(slot, owner, slot.lease)

    def _holds(self, handle: StagingSlot) -> bool:
        slot = handle._slot
        return slot.state is SlotState.HELD and slot.lease == handle.lease

    def _drain(self, slot: _Slot) -> None:
        slot.state, slot.owner = SlotState.DRAINING, None
        self._reclaim()
        self._changed.notify_all()

    def _busy_message(self, timeout_s: float) -> str:
        held = sum(s.state is SlotState.HELD for s in self._slots)
        return (f"all {self.num_slots} KV staging slots ({self.slot_bytes:,} bytes each) stayed busy for "
                f"{timeout_s:g} s ({held} held by transfers, {self.num_slots - held} waiting for their "
                "copies); "
                "the device or the network is not keeping up")


@dataclass(frozen=True)
class StagedCopies:
    """One direction of a device pool's KV path: the ring its frames pass through and the stream
    their copies are ordered on (the transfer stream on a sender, the load stream on a receiver)."""

    streams: DeviceStreams
    stream: Stream
    ring: StagingRing
    acquire_timeout_s: float = DEFAULT_ACQUIRE_TIMEOUT_S

    @classmethod
    def create(cls, streams: DeviceStreams, slot_bytes: int, num_slots: int = DEFAULT_STAGING_SLOTS,
               acquire_timeout_s: float = DEFAULT_ACQUIRE_TIMEOUT_S) -> StagedCopies:
        ring = StagingRing(streams, num_slots, slot_bytes)
        return cls(streams, streams.new_stream(), ring, acquire_timeout_s)

    def slot(self, owner: str) -> AbstractContextManager[StagingSlot]:
        return self.ring.slot(owner, self.acquire_timeout_s)

    def record(self) -> Event:
        """An event that completes once everything enqueued on this stream so far has run."""
        event = self.streams.new_event()
        event.record(self.stream)
        return event

    def after_compute(self) -> None:
        """Order this stream's later copies after the work enqueued on the current (compute) stream."""
        done = self.streams.new_event()
        done.record(self.streams.current_stream())
        self.stream.wait_event(done)


def staging_for_pool(kv_cache: torch.Tensor, slot_bytes: int,
                     num_slots: int = DEFAULT_STAGING_SLOTS) -> StagedCopies | None:
    """A device pool's own StagedCopies; None for a CPU pool (its path needs no staging)."""
    if kv_cache.device.type == "cpu":
        return None
    return StagedCopies.create(streams_for(kv_cache.device), slot_bytes, num_slots)
