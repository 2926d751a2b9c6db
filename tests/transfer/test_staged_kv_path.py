"""A device pool's KV path, proven on the CPU with CpuStreams: encode_layer and receive_layer through
a staging ring give the same frames and the same pool bytes as today's path, in the order the
streams impose (a gather after its layer's compute, a load landing only with its event), and a whole
transfer through both rings (LayerwiseSender -> KVReceiver, two engines) decodes exactly.
Streams are held with gates (test_staging_ring.Gate), never slept on.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from decode_worker.receiver import KVReceiver
from pdserve.engine.device_streams import CpuStream, CpuStreams
from pdserve.engine.hashing import hash_blocks
from pdserve.engine.sequence import SamplingParams
from pdserve.kvwire import ChecksumError, KVLayout, TransferEnd, decode_header, encode_layer, receive_layer
from pdserve.transfer.channel import Frame, PushResult
from pdserve.transfer.errors import FailureKind, TransferFailed
from pdserve.transfer.staging import SlotState, StagedCopies, StagingRing, StagingSlot, StagingTimeout
from prefill_worker.sender import LayerwiseSender
from tests.conftest import assert_no_leaks, make_engine
from tests.test_kvwire import bits, make_pool
from tests.transfer.test_staging_ring import BRIEF_S, LONG_S, Gate

DTYPES = ["float32", "bfloat16", "int8"]
SEND_IDS, POSITIONS = [7, 2, 19, 4, 11], [0, 1, 2, 3, 4]


@pytest.fixture
def staged() -> Iterator[StagedCopies]:
    staged = StagedCopies.create(CpuStreams(), slot_bytes=1024, num_slots=2)
    yield staged
    staged.stream.close()
    assert set(staged.ring.states()) == {SlotState.FREE}, "a slot was left held or in flight"
    assert staged.ring.allocated_bytes <= 2 * 1024


def copied_frames(frames) -> list[tuple[bytes, bytes]]:
    """Each frame's bytes taken before the next is pulled (a staged payload is its slot's memory)."""
    return [(bytes(header), bytes(payload)) for header, payload in frames]


def chunk_bytes(layout: KVLayout) -> int:
    return 2 * layout.block_bytes  # 5 blocks: three frames, the last one short


@pytest.mark.parametrize("kv_dtype", DTYPES)
def test_staged_frames_are_todays_frames_byte_for_byte(kv_dtype, staged):
    pool = make_pool(kv_dtype)
    layout = KVLayout.of_cache(pool, "fp")
    for layer in range(pool.shape[0]):
        today = copied_frames(encode_layer(pool, layer, SEND_IDS, POSITIONS, "t1", chunk_bytes(layout),
                                           native=False))
        through_ring = copied_frames(encode_layer(pool, layer, SEND_IDS, POSITIONS, "t1", chunk_bytes(layout),
                                                  staged=staged))
        assert len(today) == 3 and through_ring == today


@pytest.mark.parametrize("kv_dtype", DTYPES)
def test_staged_receive_writes_todays_pool_bytes(kv_dtype, staged):
    sender = make_pool(kv_dtype)
    layout = KVLayout.of_cache(sender, "fp")
    today, through_ring = make_pool(kv_dtype, random=False), make_pool(kv_dtype, random=False)
    receive_ids = [3, 9, 0, 21, 14]
    for layer in range(sender.shape[0]):
        for header, payload in copied_frames(encode_layer(sender, layer, SEND_IDS, POSITIONS, "t1",
                                                          chunk_bytes(layout))):
            frame = decode_header(header)
            ids = [receive_ids[p] for p in frame.positions]
            receive_layer(today, frame, payload, layout, ids, native=False)
            receive_layer(through_ring, frame, payload, layout, ids, staged=staged)
    staged.record().synchronize()
    assert torch.equal(bits(through_ring), bits(today))
    assert torch.equal(bits(through_ring[:, :, receive_ids]), bits(sender[:, :, SEND_IDS]))


def test_a_frame_larger_than_a_slot_goes_through_it_a_slot_at_a_time(staged):
    sender, receiver = make_pool("float32"), make_pool("float32", random=False)
    layout = KVLayout.of_cache(sender, "fp")
    assert 5 * layout.block_bytes > staged.ring.slot_bytes
    (header, payload), = copied_frames(encode_layer(sender, 1, SEND_IDS, POSITIONS, "t1", 1 << 20))
    receive_layer(receiver, decode_header(header), payload, layout, [0, 1, 2, 3, 4], staged=staged)
    staged.record().synchronize()
    assert torch.equal(bits(receiver[1, :, :5]), bits(sender[1, :, SEND_IDS]))


def test_a_staged_receive_returns_before_its_load_lands_and_the_event_says_when(staged):
    sender, receiver = make_pool("float32"), make_pool("float32", random=False)
    layout = KVLayout.of_cache(sender, "fp")
    (header, payload), = copied_frames(encode_layer(sender, 0, [5], [0], "t1"))
    gate = Gate()
    gate.hold(staged.stream)
    receive_layer(receiver, decode_header(header), payload, layout, [8], staged=staged)
    landed = staged.record()
    assert not landed.query() and torch.count_nonzero(receiver) == 0, "the load did not wait for its stream"
    assert staged.ring.states().count(SlotState.DRAINING) == 1  # released, its copy still queued
    gate.open()
    landed.synchronize()
    assert torch.equal(bits(receiver[0, :, 8]), bits(sender[0, :, 5]))


def test_a_staged_gather_waits_for_its_layers_compute_event(staged):
    pool = make_pool("float32", random=False)
    compute, gate, frames = CpuStream(), Gate(), []
    try:
        gate.hold(compute)
        compute.submit(lambda: pool[2, :, 6].fill_(1.5))  # the layer's compute, not yet run
        written = staged.streams.new_event()
        written.record(compute)
        reader = threading.Thread(target=lambda: frames.extend(copied_frames(
            encode_layer(pool, 2, [6], [0], "t1", staged=staged, after=written))))
        reader.start()
        gate.open()
        reader.join(LONG_S)
    finally:
        compute.close()
    (header, payload), = frames
    sent = torch.frombuffer(bytearray(payload), dtype=torch.float32)
    assert torch.all(sent == 1.5), "the gather ran before the layer it sends was written"


def test_a_corrupt_staged_frame_writes_nothing_and_frees_its_slot(staged):
    sender, receiver = make_pool("float32"), make_pool("float32", random=False)
    layout = KVLayout.of_cache(sender, "fp")
    (header, payload), = copied_frames(encode_layer(sender, 2, [1, 5], [0, 1], "t1"))
    corrupt = bytearray(payload)
    corrupt[-1] ^= 1
    with pytest.raises(ChecksumError, match="block position 1"):
        receive_layer(receiver, decode_header(header), bytes(corrupt), layout, [3, 4], staged=staged)
    staged.record().synchronize()
    assert torch.count_nonzero(receiver) == 0


def test_closing_a_staged_encoder_mid_layer_releases_its_slot(staged):
    pool = make_pool("float32")
    layout = KVLayout.of_cache(pool, "fp")
    frames = encode_layer(pool, 0, SEND_IDS, POSITIONS, "t1", chunk_bytes(layout), staged=staged)
    next(frames)
    assert staged.ring.states().count(SlotState.HELD) == 1  # the frame's slot, until it is consumed
    frames.close()  # the sender aborted
    assert SlotState.HELD not in staged.ring.states()


# --- a whole transfer through both rings ------------------------------------------------------------
PROMPT = list(range(300, 350))  # 3 full blocks of 16 and a partial one
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


class InProcessChannel:
    """Hands the frames straight to a receiver; end_read is set once the receiver has read END."""

    def __init__(self, receiver: KVReceiver) -> None:
        self.receiver, self.end_read = receiver, threading.Event()

    def push(self, frames: Iterator[Frame], timeout_s: float) -> PushResult:
        report = self.receiver.receive(self._watched(frames))
        return PushResult(report.transfer_id, report.blocks_written, report.bytes_received)

    def _watched(self, frames: Iterator[Frame]) -> Iterator[Frame]:
        for header, payload in frames:
            if not payload and isinstance(decode_header(header), TransferEnd):
                self.end_read.set()  # NOTE: before the yield: the receiver pulls nothing after END
            yield header, payload


def run_to_end(engine, observer=None) -> list[int]:
    tokens = []
    while engine.has_unfinished():
        tokens += [t for out in engine.step(observer) for t in out.new_token_ids]
    return tokens


def transfer_and_decode(tiny_loaded, hold_loads: bool = False) -> tuple[list[int], bool]:
    prefill, decode = make_engine(tiny_loaded, num_blocks=16), make_engine(tiny_loaded, num_blocks=16)
    layout = KVLayout.of_cache(prefill.kv_cache, prefill.fingerprint)
    slot_bytes = max(4096, layout.block_bytes)
    # NOTE: with its loads held, the receiver keeps each frame's slot until the gate opens: enough slots
    # for every frame, or it would wait for one (the ring's backpressure) and never read END.
    send = StagedCopies.create(CpuStreams(), slot_bytes, num_slots=2)
    load = StagedCopies.create(CpuStreams(), slot_bytes, num_slots=64 if hold_loads else 2)
    sender = LayerwiseSender(prefill, layout, max_chunk_bytes=4096, staged=send)
    channel = InProcessChannel(KVReceiver(decode, layout, staged=load))
    gate = Gate()
    if hold_loads:
        gate.hold(load.stream)
    transfer = sender.start("r", PROMPT, 0, channel, timeout_s=30)
    prefill.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=1), request_id="r", detokenize=False)
    first = run_to_end(prefill, sender)
    transfer.close()
    parked_before_loads = None
    if hold_loads:
        assert channel.end_read.wait(LONG_S)
        parked_before_loads = decode.handoff.is_parked("r")
        gate.open()
    transfer.wait()
    sender.finish("r")
    prefill_blocks = prefill.pool.match_prefix(hash_blocks(PROMPT, prefill.block_size, prefill.salt))
    decode_blocks = decode.pool.match_prefix(hash_blocks(PROMPT, decode.block_size, decode.salt))
    assert len(decode_blocks) == 3 and torch.equal(bits(decode.kv_cache[:, :, decode_blocks]),
                                                   bits(prefill.kv_cache[:, :, prefill_blocks]))
    decode.resume_transferred("r", PROMPT, first[0], GREEDY, detokenize=False)
    tokens = first + run_to_end(decode)
    for staged in (send, load):
        assert set(staged.ring.states()) == {SlotState.FREE}
        staged.stream.close()
    assert_no_leaks(prefill), assert_no_leaks(decode)
    return tokens, parked_before_loads


def test_a_transfer_through_both_rings_decodes_exactly(tiny_loaded):
    tokens, _ = transfer_and_decode(tiny_loaded)
    reference = make_engine(tiny_loaded).generate([PROMPT], GREEDY, detokenize=False)[0].token_ids
    assert tokens == reference


def test_the_receiver_parks_only_once_its_loads_have_landed(tiny_loaded):
    tokens, parked_before_loads = transfer_and_decode(tiny_loaded, hold_loads=True)
    assert parked_before_loads is False, "the KV was parked (committed to the prefix cache) before it landed"
    assert len(tokens) == GREEDY.max_tokens


class OpensGateOnTimeout(StagingRing):
    """A ring that, when an acquire times out, lets the held load stream go on."""

    def __init__(self, gate: Gate, *args) -> None:
        super().__init__(*args)
        self.gate = gate

    def acquire(self, owner: str, timeout_s: float = LONG_S) -> StagingSlot:
        try:
            return super().acquire(owner, timeout_s)
        except StagingTimeout:
            self.gate.open()
            raise


def test_a_receiver_out_of_staging_slots_fails_busy_and_frees_its_blocks_after_its_loads(tiny_loaded):
    prefill, decode = make_engine(tiny_loaded, num_blocks=16), make_engine(tiny_loaded, num_blocks=16)
    layout = KVLayout.of_cache(prefill.kv_cache, prefill.fingerprint)
    streams, gate = CpuStreams(), Gate()
    one_slot = OpensGateOnTimeout(gate, streams, 1, layout.block_bytes)
    load = StagedCopies(streams, streams.new_stream(), one_slot, acquire_timeout_s=BRIEF_S)
    gate.hold(load.stream)  # the first frame's load holds the only slot until the second times out
    receiver = KVReceiver(decode, layout, staged=load)
    sender = LayerwiseSender(prefill, layout, max_chunk_bytes=layout.block_bytes)
    transfer = sender.start("r", PROMPT, 0, InProcessChannel(receiver), timeout_s=30)
    prefill.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=1), request_id="r", detokenize=False)
    run_to_end(prefill, sender)
    transfer.close()
    with pytest.raises(TransferFailed, match="KV staging slots") as failed:
        transfer.wait()
    assert failed.value.kind is FailureKind.RESOURCE_EXHAUSTED
    assert receiver.outcomes[FailureKind.RESOURCE_EXHAUSTED.value] == 1
    sender.finish("r")
    assert load.ring.states() == [SlotState.FREE] and not decode.handoff.is_parked("r")
    load.stream.close()
    assert_no_leaks(prefill), assert_no_leaks(decode)


def test_a_sender_out_of_staging_slots_fails_busy_and_frees_its_blocks(tiny_loaded):
    """The sending side's ring held by another transfer for the whole acquire timeout: the push fails
    RESOURCE_EXHAUSTED (busy, retry later), as the receiver's does, not INTERNAL."""
    prefill, decode = make_engine(tiny_loaded, num_blocks=16), make_engine(tiny_loaded, num_blocks=16)
    layout = KVLayout.of_cache(prefill.kv_cache, prefill.fingerprint)
    streams = CpuStreams()
    send = StagedCopies(streams, streams.new_stream(), StagingRing(streams, 1, layout.block_bytes),
                        acquire_timeout_s=BRIEF_S)
    held = send.ring.acquire("another transfer")
    sender = LayerwiseSender(prefill, layout, max_chunk_bytes=layout.block_bytes, staged=send)
    transfer = sender.start("r", PROMPT, 0, InProcessChannel(KVReceiver(decode, layout)), timeout_s=30)
    prefill.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=1), request_id="r", detokenize=False)
    run_to_end(prefill, sender)
    transfer.close()
    with pytest.raises(TransferFailed, match="staging") as failed:
        transfer.wait()
    assert failed.value.kind is FailureKind.RESOURCE_EXHAUSTED
    sender.finish("r")
    send.ring.release(held)
    assert send.ring.states() == [SlotState.FREE] and not decode.handoff.is_parked("r")
    send.stream.close()
    assert_no_leaks(prefill), assert_no_leaks(decode)
