"""KV handoff logic through the in-process loopback transport (tiny model, fast)."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.sequence import SamplingParams
from pdserve.kvwire import KVLayout
from pdserve.transfer.errors import FailureKind, TransferFailed
from pdserve.transfer.loopback import LoopbackKVChannel
from pdserve.transfer.receiver import KVReceiver
from tests.conftest import assert_no_leaks, make_engine
from tests.transfer.harness import (
    PrefillSide,
    decode_after_transfer,
    layout_of,
    receiver_for,
    single_engine_tokens,
)

PROMPT = list(range(300, 350))  # 50 tokens: 4 blocks of 16, the last partial


class CorruptingChannel(LoopbackKVChannel):
    """Flips one byte in the payload of the n-th LAYER frame."""

    def __init__(self, receiver, frame_index: int = 3) -> None:
        super().__init__(receiver)
        self.frame_index = frame_index

    def push(self, frames, timeout_s):
        def corrupt():
            for i, (header, payload) in enumerate(frames):
                if i == self.frame_index:
                    payload = bytearray(payload)
                    payload[len(payload) // 2] ^= 0x40
                    payload = bytes(payload)
                yield header, payload
        return super().push(corrupt(), timeout_s)


@pytest.fixture
def pair(tiny_loaded):
    prefill = PrefillSide.of(make_engine(tiny_loaded, budget=20), max_chunk_bytes=4096)
    decode = make_engine(tiny_loaded)
    yield prefill, decode
    for engine in (prefill.engine, decode):
        assert_no_leaks(engine)


def test_transferred_kv_decodes_exactly_like_one_engine(pair, tiny_loaded):
    prefill, decode = pair
    expected = single_engine_tokens(make_engine(tiny_loaded), PROMPT)
    outcome = prefill.push("r1", PROMPT, LoopbackKVChannel(receiver_for(decode)))
    # 4 blocks x 2 layers, chunked prefill (budget 20) sent blocks as they completed
    assert outcome.push.blocks_written == 4 * tiny_loaded.config.num_layers
    tokens, used = decode_after_transfer(decode, "r1", PROMPT, outcome.first_token, outcome.rng_state)
    assert used and tokens == expected


def test_receiver_cached_prefix_is_not_sent(pair, tiny_loaded):
    prefill, decode = pair
    layout = layout_of(decode)
    decode.generate([PROMPT[:40]], SamplingParams(temperature=0, max_tokens=1), detokenize=False)
    outcome = prefill.push("r2", PROMPT, LoopbackKVChannel(receiver_for(decode)), receiver_cached_blocks=2)
    assert outcome.push.blocks_written == 2 * layout.num_layers  # blocks 2 and 3 only
    assert outcome.push.bytes_sent == 2 * layout.num_layers * layout.block_bytes
    tokens, used = decode_after_transfer(decode, "r2", PROMPT, outcome.first_token, outcome.rng_state)
    assert used and tokens == single_engine_tokens(make_engine(tiny_loaded), PROMPT)


def test_seeded_sampling_continues_the_same_random_stream(pair, tiny_loaded):
    prefill, decode = pair
    sampling = SamplingParams(temperature=1.0, top_p=0.95, seed=11, max_tokens=10, ignore_eos=True)
    expected = single_engine_tokens(make_engine(tiny_loaded), PROMPT, sampling)
    outcome = prefill.push("r3", PROMPT, LoopbackKVChannel(receiver_for(decode)), sampling=sampling)
    tokens, used = decode_after_transfer(decode, "r3", PROMPT, outcome.first_token, outcome.rng_state,
                                         sampling)
    assert used and tokens == expected


def test_flipped_byte_is_detected_and_local_recompute_is_exact(pair, tiny_loaded):
    prefill, decode = pair
    receiver = receiver_for(decode)
    with pytest.raises(TransferFailed) as failure:
        prefill.push("r4", PROMPT, CorruptingChannel(receiver))
    assert failure.value.kind is FailureKind.DATA_LOSS and "checksum mismatch" in failure.value.message
    assert decode.leaked_blocks() == [] and not decode.has_parked("r4")
    assert receiver.outcomes["DATA_LOSS"] == 1
    tokens, used = decode_after_transfer(decode, "r4", PROMPT, 0, None)
    assert not used and tokens == single_engine_tokens(make_engine(tiny_loaded), PROMPT)


@pytest.mark.parametrize("field, change", [
    ("model_fingerprint", {"model_fingerprint": "0" * 64}),
    ("block_size", {"block_size": 8}),
    ("kv_dtype", {"kv_dtype": "float16"}),
])
def test_layout_mismatch_fails_precondition_naming_the_field(pair, field, change):
    prefill, decode = pair
    theirs = layout_of(decode)
    receiver = KVReceiver(decode, KVLayout(**{**theirs.__dict__, **change}))
    free_before = decode.pool.num_free_blocks
    with pytest.raises(TransferFailed) as failure:
        prefill.push("r5", PROMPT, LoopbackKVChannel(receiver))
    assert failure.value.kind is FailureKind.FAILED_PRECONDITION
    assert field in failure.value.message
    assert decode.pool.num_free_blocks == free_before and decode.pool.num_cached_blocks == 0


def test_pool_too_small_is_resource_exhausted(tiny_loaded):
    prefill = PrefillSide.of(make_engine(tiny_loaded))
    decode = make_engine(tiny_loaded, num_blocks=8)
    decode.add_request(list(range(1, 90)), SamplingParams(max_tokens=50), request_id="busy")
    decode.step()  # "busy" holds 6 of the 8 blocks; the transfer needs 4
    with pytest.raises(TransferFailed) as failure:
        prefill.push("r6", PROMPT, LoopbackKVChannel(receiver_for(decode)))
    assert failure.value.kind is FailureKind.RESOURCE_EXHAUSTED
    assert "retry later" in failure.value.message
    assert decode.abort("busy")
    assert_no_leaks(decode)
    assert_no_leaks(prefill.engine)


def test_claimed_prefix_the_receiver_lost_fails_precondition(pair):
    prefill, decode = pair
    with pytest.raises(TransferFailed) as failure:
        prefill.push("r7", PROMPT, LoopbackKVChannel(receiver_for(decode)), receiver_cached_blocks=2)
    assert failure.value.kind is FailureKind.FAILED_PRECONDITION
    assert "holds 0 of the 2 prefix blocks" in failure.value.message


def test_parked_transfer_expires_and_frees_its_blocks(pair):
    prefill, decode = pair
    receiver = KVReceiver(decode, layout_of(decode), parked_ttl_s=0.0)
    prefill.push("r8", PROMPT, LoopbackKVChannel(receiver))
    assert decode.has_parked("r8") and decode.leaked_blocks()
    decode.step()  # the engine sweeps expired reservations every step
    assert not decode.has_parked("r8")


def test_sender_sends_each_block_once_per_layer_under_chunked_prefill(tiny_loaded):
    prefill = PrefillSide.of(make_engine(tiny_loaded, budget=7), max_chunk_bytes=1)  # 1 block per frame
    decode = make_engine(tiny_loaded)
    seen: list[tuple[int, tuple[int, ...]]] = []

    class Recording(LoopbackKVChannel):
        def push(self, frames, timeout_s):
            from pdserve.kvwire import LayerChunkHeader, decode_header

            def record():
                for header, payload in frames:
                    frame = decode_header(header)
                    if isinstance(frame, LayerChunkHeader):
                        seen.append((frame.layer, frame.positions))
                    yield header, payload
            return super().push(record(), timeout_s)

    outcome = prefill.push("r9", PROMPT, Recording(receiver_for(decode)))
    layers = tiny_loaded.config.num_layers
    assert sorted(seen) == sorted((layer, (p,)) for layer in range(layers) for p in range(4))
    decode_after_transfer(decode, "r9", PROMPT, outcome.first_token, outcome.rng_state)
    assert_no_leaks(decode)
    assert_no_leaks(prefill.engine)
    assert torch.is_tensor(outcome.rng_state)
