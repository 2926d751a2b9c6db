"""KV transfer across processes over a real gRPC socket (acceptance of the KV transfer issue).

Prefill runs here; decode runs in another process behind a KVTransfer server.
"""

from __future__ import annotations

import time

import pytest

from pdserve.engine.sequence import SamplingParams
from pdserve.transfer.errors import FailureKind, TransferFailed
from pdserve.transfer.grpc_transport import GrpcKVChannel
from tests.conftest import assert_no_leaks, make_engine
from tests.transfer.harness import PrefillSide, single_engine_tokens
from tests.transfer.processes import DecodeProcess, start_stalling_sender

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def smol_decode():
    process = DecodeProcess(None)  # SmolLM2
    yield process
    process.close()


@pytest.fixture(scope="module")
def smol_prefill(smollm_loaded):
    return PrefillSide.of(make_engine(smollm_loaded, budget=64))


def chat(loaded, text: str) -> list[int]:
    return loaded.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def test_greedy_tokens_identical_to_one_engine(smollm_loaded, smol_prefill, smol_decode):
    channel = GrpcKVChannel(smol_decode.target)
    reference = make_engine(smollm_loaded)
    prompts = [chat(smollm_loaded, "What is the capital of France?"),
               chat(smollm_loaded, "Write a haiku about the sea. " * 6),
               list(range(1000, 1017))]
    for i, prompt in enumerate(prompts):
        outcome = smol_prefill.push(f"x{i}", prompt, channel)
        tokens, used = smol_decode.decode(f"x{i}", prompt, outcome.first_token, outcome.rng_state, GREEDY)
        assert used, "the decode process fell back to local prefill"
        assert tokens == single_engine_tokens(reference, prompt, GREEDY)
    assert_no_leaks(smol_prefill.engine)
    assert smol_decode.wait_until_clean(5)[0] < 5


def test_receiver_cached_prefix_sends_fewer_bytes(smollm_loaded, smol_prefill, smol_decode):
    channel = GrpcKVChannel(smol_decode.target)
    system = "You are a careful assistant who answers in one short sentence. " * 4
    first = smollm_loaded.tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": "Name a colour."}])
    second = smollm_loaded.tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": "Name a fruit."}])
    shared_blocks = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b) // 16
    assert shared_blocks >= 2
    cold = smol_prefill.push("c1", first, channel)
    smol_decode.decode("c1", first, cold.first_token, cold.rng_state, GREEDY)  # decode side now caches it
    warm = smol_prefill.push("c2", second, channel, receiver_cached_blocks=shared_blocks)
    tokens, used = smol_decode.decode("c2", second, warm.first_token, warm.rng_state, GREEDY)
    layers, block_bytes = smollm_loaded.config.num_layers, smol_prefill.sender.layout.block_bytes
    total_blocks = -(-len(second) // 16)
    assert cold.push.bytes_sent == layers * -(-len(first) // 16) * block_bytes
    assert warm.push.bytes_sent == layers * (total_blocks - shared_blocks) * block_bytes
    assert used and tokens == single_engine_tokens(make_engine(smollm_loaded), second, GREEDY)
    assert_no_leaks(smol_prefill.engine)
    assert smol_decode.wait_until_clean(5)[0] < 5


def test_flipped_byte_over_grpc_is_detected_and_recompute_is_exact(smollm_loaded, smol_prefill, smol_decode):
    class Corrupting(GrpcKVChannel):
        def push(self, frames, timeout_s):
            def corrupt():
                for i, (header, payload) in enumerate(frames):
                    if i == 5:
                        payload = bytearray(payload)
                        payload[7] ^= 0x01
                        payload = bytes(payload)
                    yield header, payload
            return super().push(corrupt(), timeout_s)

    prompt = chat(smollm_loaded, "Tell me about rivers.")
    with pytest.raises(TransferFailed) as failure:
        smol_prefill.push("bad", prompt, Corrupting(smol_decode.target))
    assert failure.value.kind is FailureKind.DATA_LOSS
    elapsed, stats = smol_decode.wait_until_clean(5)
    assert elapsed < 5, stats
    tokens, used = smol_decode.decode("bad", prompt, 0, None, GREEDY)
    assert not used and tokens == single_engine_tokens(make_engine(smollm_loaded), prompt, GREEDY)
    assert_no_leaks(smol_prefill.engine)


# --- faults on the tiny model: the processes start fast --------------------------------------
@pytest.fixture
def tiny_decode(tiny_model_dir):
    process = DecodeProcess(str(tiny_model_dir))
    yield process
    process.close()


@pytest.mark.parametrize("kill", [True, False], ids=["sender-killed", "sender-stalls-past-deadline"])
def test_receiver_frees_reservation_within_the_deadline(tiny_model_dir, tiny_decode, kill):
    deadline_s = 3.0
    prompt = list(range(500, 580))  # 5 blocks
    sender, _ = start_stalling_sender(str(tiny_model_dir), tiny_decode.target, prompt, deadline_s)
    started = time.monotonic()
    while not tiny_decode.stats()["leaked"]:  # BEGIN may still be in flight
        assert time.monotonic() - started < 2, "the receiver never reserved blocks for the stream"
        time.sleep(0.02)
    if kill:
        sender.kill()
    elapsed, stats = tiny_decode.wait_until_clean(deadline_s + 5)
    assert time.monotonic() - started <= deadline_s + 1.0, stats
    assert stats["free"] == stats["num_blocks"]
    expected = "CANCELLED" if kill else "DEADLINE_EXCEEDED"
    assert stats["outcomes"] == {expected: 1}, stats
    sender.kill()
    sender.join(5)


@pytest.mark.parametrize("field, engine_kwargs", [
    ("block_size", {"block_size": 8}),
    ("kv_dtype", {"kv_dtype": "float16"}),
])
def test_layout_mismatch_over_grpc_is_failed_precondition(tiny_loaded, tiny_model_dir, field, engine_kwargs):
    decode = DecodeProcess(str(tiny_model_dir), **engine_kwargs)
    try:
        prefill = PrefillSide.of(make_engine(tiny_loaded))
        with pytest.raises(TransferFailed) as failure:
            prefill.push("m", list(range(40)), GrpcKVChannel(decode.target))
        assert failure.value.kind is FailureKind.FAILED_PRECONDITION and field in failure.value.message
        stats = decode.stats()
        assert stats["free"] == stats["num_blocks"] and not stats["parked"]
        assert_no_leaks(prefill.engine)
    finally:
        decode.close()


def test_fingerprint_mismatch_over_grpc_is_failed_precondition(tiny_model_dir, smollm_loaded):
    decode = DecodeProcess(str(tiny_model_dir))  # another model altogether
    try:
        prefill = PrefillSide.of(make_engine(smollm_loaded))
        with pytest.raises(TransferFailed) as failure:
            prefill.push("f", list(range(40)), GrpcKVChannel(decode.target))
        assert failure.value.kind is FailureKind.FAILED_PRECONDITION
        assert "model_fingerprint" in failure.value.message
        stats = decode.stats()
        assert stats["free"] == stats["num_blocks"]
    finally:
        decode.close()
