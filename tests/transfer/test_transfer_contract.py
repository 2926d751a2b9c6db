"""The KV transfer contract: every scenario over the loopback, gRPC and fault-injecting channels.

A prefill worker and a decode worker (tiny model, production WorkerServers, called over real
gRPC: tests/helpers/rig.py) hand a prompt's KV over the channel under test. Whatever
happens to the transfer, the decode worker must never cache or use a block that is not the
prompt's true KV, and every flow ends with both workers clean.
"""

from __future__ import annotations

import grpc
import pytest

from pdserve.engine.sequence import SamplingParams
from pdserve.engine.tiny_model import write_tiny_model
from pdserve.engine.weights import load_model
from pdserve.worker.convert import sampling_to_proto
from prefill_worker.faults import FaultKind, FaultRule, RequestIds
from protos.pdserve.v1 import worker_pb2
from tests.helpers.rig import (
    CHANNELS,
    assert_no_wrong_kv,
    cached_prompt_blocks,
    engine_config,
    hold,
    reference_tokens,
    start_rig,
)
from tests.helpers.waiting import eventually
from tests.helpers.workers import wait_until_clean

PROMPT = list(range(300, 350))  # 50 tokens: 3 full blocks of 16 and a partial one
FILLER = [(7 * j) % 400 + 600 for j in range(112)]  # 7 blocks of other tokens: overwrites a small pool


@pytest.fixture(params=CHANNELS)
def kind_param(request) -> str:
    return request.param


def finished_transfers(worker) -> int:
    return sum(worker.status().transfer_outcomes.values())


@pytest.fixture(params=CHANNELS)
def rig(request, tiny_loaded):
    """P with a 20-token budget (chunked prefill), D with a 128-block pool."""
    rig = start_rig(tiny_loaded, request.param, prefill_engine=engine_config(budget=20), max_chunk_bytes=4096)
    yield rig
    wait_until_clean(rig.prefill, rig.decode)
    assert_no_wrong_kv(rig.prefill, rig.decode)
    rig.close()


def layers(loaded) -> int:
    return loaded.config.num_layers


# --- transfers that complete -------------------------------------------------------------------------
def test_transferred_kv_decodes_exactly_like_one_engine(rig, tiny_loaded):
    reply = rig.remote_prefill("r1", PROMPT)
    # 4 blocks x 2 layers, sent as chunked prefill (budget 20) completed them
    assert reply.blocks_sent == 4 * layers(tiny_loaded) and reply.usage.prompt_tokens == len(PROMPT)
    tokens, used = rig.decode_tokens("r1", PROMPT, reply)
    assert used and tokens == reference_tokens(tiny_loaded, PROMPT)
    assert rig.decode.status().transfer_outcomes == {"done": 1}
    assert rig.prefill.status().send_outcomes == {"done": 1}


def test_receiver_cached_prefix_is_not_sent(rig, tiny_loaded):
    rig.decode_tokens("warm", PROMPT[:40], sampling=SamplingParams(temperature=0, max_tokens=1))
    assert cached_prompt_blocks(rig.decode, PROMPT) == 2
    reply = rig.remote_prefill("r2", PROMPT, decode_cached_blocks=2)
    assert reply.blocks_sent == 2 * layers(tiny_loaded)  # blocks 2 and 3 only
    assert reply.bytes_sent == 2 * layers(tiny_loaded) * rig.prefill.layout.block_bytes
    tokens, used = rig.decode_tokens("r2", PROMPT, reply)
    assert used and tokens == reference_tokens(tiny_loaded, PROMPT)


def test_seeded_sampling_continues_the_same_random_stream(rig, tiny_loaded):
    sampling = SamplingParams(temperature=1.0, top_p=0.95, seed=11, max_tokens=10, ignore_eos=True)
    reply = rig.remote_prefill("r3", PROMPT, sampling)
    tokens, used = rig.decode_tokens("r3", PROMPT, reply, sampling)
    assert used and tokens == reference_tokens(tiny_loaded, PROMPT, sampling)


def test_each_block_goes_once_per_layer_under_chunked_prefill(tiny_loaded, kind_param):
    """Budget 7 computes a block over 3 steps and max_chunk_bytes 1 sends one block per frame. The
    receiver refuses a block it already has, and END's totals must match what arrived, so a
    transfer that completes with 4 blocks x layers sent each exactly once."""
    rig = start_rig(tiny_loaded, kind_param, prefill_engine=engine_config(budget=7), max_chunk_bytes=1)
    try:
        reply = rig.remote_prefill("r4", PROMPT)
        assert reply.blocks_sent == 4 * layers(tiny_loaded)
        assert reply.bytes_sent == 4 * layers(tiny_loaded) * rig.prefill.layout.block_bytes
        tokens, used = rig.decode_tokens("r4", PROMPT, reply)
        assert used and tokens == reference_tokens(tiny_loaded, PROMPT)
        wait_until_clean(rig.prefill, rig.decode)
        assert_no_wrong_kv(rig.prefill, rig.decode)
    finally:
        rig.close()


def test_parked_kv_expires_and_the_decode_call_prefills_instead(tiny_loaded, kind_param):
    rig = start_rig(tiny_loaded, kind_param, parked_ttl_s=0.0)
    try:
        reply = rig.remote_prefill("r5", PROMPT)
        eventually(lambda: rig.decode.status().parked_transfers == 0, 5, "the engine loop swept it")
        tokens, used = rig.decode_tokens("r5", PROMPT, reply)
        assert not used and tokens == reference_tokens(tiny_loaded, PROMPT)
        wait_until_clean(rig.prefill, rig.decode)
        assert_no_wrong_kv(rig.prefill, rig.decode)
    finally:
        rig.close()


# --- transfers the receiver refuses or fails: nothing is used, the prompt is recomputed exactly -------
def assert_refused(rig, loaded, request_id: str, code: grpc.StatusCode, message: str) -> None:
    with pytest.raises(grpc.RpcError) as failure:
        rig.remote_prefill(request_id, PROMPT)
    assert failure.value.code() is code and message in failure.value.details(), failure.value.details()
    assert cached_prompt_blocks(rig.decode, PROMPT) == 0
    tokens, used = rig.decode_tokens(request_id, PROMPT)
    assert not used and tokens == reference_tokens(loaded, PROMPT)
    wait_until_clean(rig.prefill, rig.decode)
    assert_no_wrong_kv(rig.prefill, rig.decode)


def test_flipped_byte_is_detected_and_the_recompute_is_exact(tiny_loaded, kind_param):
    corrupt = FaultRule(FaultKind.CORRUPT, RequestIds({"r6"}), at_frame=1)
    rig = start_rig(tiny_loaded, kind_param, rules=(corrupt,))
    try:
        assert_refused(rig, tiny_loaded, "r6", grpc.StatusCode.DATA_LOSS, "checksum mismatch")
        assert rig.decode.status().transfer_outcomes == {"DATA_LOSS": 1}
        assert rig.prefill.status().send_outcomes == {"DATA_LOSS": 1}
    finally:
        rig.close()


@pytest.fixture(scope="module")
def other_tiny_loaded(tmp_path_factory):
    """A second tiny model: same shapes, other weights, so another fingerprint."""
    return load_model(str(write_tiny_model(tmp_path_factory.mktemp("tiny-other"), seed=1)), progress=False)


@pytest.mark.parametrize(("field", "named"), [("block_size", "block_size: sender 16, receiver 8"),
                                               ("kv_dtype", "kv_dtype: sender float32, receiver float16"),
                                               ("model_fingerprint", "model_fingerprint: sender ")])
def test_layout_mismatch_fails_precondition_naming_the_field(tiny_loaded, other_tiny_loaded, kind_param,
                                                             field, named):
    decode_engine = {"block_size": engine_config(block_size=8), "kv_dtype": engine_config(kv_dtype="float16"),
                     "model_fingerprint": engine_config()}[field]
    rig = start_rig(tiny_loaded, kind_param, decode_engine=decode_engine,
                    decode_loaded=other_tiny_loaded if field == "model_fingerprint" else None)
    try:
        with pytest.raises(grpc.RpcError) as failure:
            rig.remote_prefill("r7", PROMPT)
        assert failure.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert named in failure.value.details()  # each side's value under its own name
        assert rig.decode.status().transfer_outcomes == {"FAILED_PRECONDITION": 1}
        wait_until_clean(rig.prefill, rig.decode)
        assert_no_wrong_kv(rig.prefill, rig.decode)
    finally:
        rig.close()


def test_pool_too_small_is_resource_exhausted(tiny_loaded, kind_param):
    rig = start_rig(tiny_loaded, kind_param, decode_engine=engine_config(num_blocks=8))
    try:
        busy = rig.stub(rig.decode).Decode(worker_pb2.DecodeRequest(
            request_id="busy", prompt_token_ids=list(range(1, 90)), prefill_here=True,
            sampling=sampling_to_proto(SamplingParams(max_tokens=50, ignore_eos=True))), timeout=60)
        next(busy)  # "busy" holds 6 of the 8 blocks; the transfer needs 4
        with pytest.raises(grpc.RpcError) as failure:
            rig.remote_prefill("r8", PROMPT)
        assert failure.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "retry later" in failure.value.details()
        busy.cancel()
        wait_until_clean(rig.prefill, rig.decode)
        assert_no_wrong_kv(rig.prefill, rig.decode)
    finally:
        rig.close()


def test_claimed_prefix_the_receiver_lost_fails_precondition(rig, tiny_loaded):
    with pytest.raises(grpc.RpcError) as failure:
        rig.remote_prefill("r9", PROMPT, decode_cached_blocks=2)
    assert failure.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "holds 0 of the 2 prefix blocks" in failure.value.details()


# --- the sender must never read a block it no longer holds -----------------------------------------
@pytest.fixture(params=CHANNELS)
def held_rig(request, tiny_loaded):
    """P with an 8-block pool, one block per LAYER frame, and 'victim's transfer held after frame 0."""
    rig = start_rig(tiny_loaded, request.param, rules=(hold("victim"),), max_chunk_bytes=1,
                    prefill_engine=engine_config(num_blocks=8))
    yield rig
    rig.gate.open()
    assert_no_wrong_kv(rig.prefill, rig.decode)
    rig.close()


def overwrite_freed_blocks_then_let_the_sender_go_on(rig) -> None:
    """Once P has let go of the victim's blocks, give them to another request (its prompt fills
    P's whole pool), and only then let the held sender gather the rest of the victim's blocks."""
    eventually(lambda: rig.prefill.status().used_blocks == 0, 10, "P released the victim's blocks")
    one_token = SamplingParams(temperature=0, max_tokens=1)
    filler = rig.remote_prefill("filler", FILLER, one_token)  # P computes it into the freed blocks
    rig.decode_tokens("filler", FILLER, filler, one_token)
    rig.gate.open()
    eventually(lambda: finished_transfers(rig.decode) == 2, 10, "D ended the victim's transfer")


def assert_victim_left_nothing_and_the_prompt_stays_exact(rig, loaded) -> None:
    assert cached_prompt_blocks(rig.decode, PROMPT) == 0, "D cached blocks of an aborted transfer"
    assert rig.decode.status().transfer_outcomes["done"] == 1  # the filler's, not the victim's
    tokens, used = rig.decode_tokens("again", PROMPT)
    assert not used and tokens == reference_tokens(loaded, PROMPT)
    wait_until_clean(rig.prefill, rig.decode)


def test_cancel_while_the_prefill_worker_waits_on_the_transfer(held_rig, tiny_loaded):
    rig = held_rig
    call = rig.stub(rig.prefill).Prefill.future(rig.prefill_request("victim", PROMPT), timeout=60)
    assert rig.gate.reached.wait(30), "the transfer never reached the gate"
    eventually(lambda: not rig.prefill.engine.has_unfinished(), 10, "P computed the prompt")
    call.cancel()
    overwrite_freed_blocks_then_let_the_sender_go_on(rig)
    assert_victim_left_nothing_and_the_prompt_stays_exact(rig, tiny_loaded)


def test_a_cancel_during_a_step_does_not_hold_up_the_prefill_workers_other_calls(held_rig, tiny_loaded):
    """gRPC runs a call's end callbacks on the server's one event thread. Prefill's let go of its
    transfer's pinned blocks there, which takes the engine's lock: while a step ran, every call of
    the worker, new ones included, waited for it (the same defect as Decode's, docs/simulator.md)."""
    rig = held_rig
    call = rig.stub(rig.prefill).Prefill.future(rig.prefill_request("victim", PROMPT), timeout=60)
    assert rig.gate.reached.wait(30), "the transfer never reached the gate"
    eventually(lambda: not rig.prefill.engine.has_unfinished(), 10, "P computed the prompt")
    assert rig.prefill.status().held_blocks > 0  # the held transfer still pins blocks it has to send
    with rig.prefill.engine.lock:  # what a step holds while it runs
        call.cancel()
        status = rig.stub(rig.prefill).Status(worker_pb2.StatusRequest(), timeout=5)  # a new call, answered
        assert status.worker_id == rig.prefill.config.worker_id
    overwrite_freed_blocks_then_let_the_sender_go_on(rig)
    assert_victim_left_nothing_and_the_prompt_stays_exact(rig, tiny_loaded)


def test_deadline_while_the_prefill_worker_waits_on_the_transfer(held_rig, tiny_loaded):
    rig = held_rig
    call = rig.stub(rig.prefill).Prefill.future(rig.prefill_request("victim", PROMPT), timeout=3)
    assert rig.gate.reached.wait(30), "the transfer never reached the gate"
    assert call.exception(30).code() is grpc.StatusCode.DEADLINE_EXCEEDED
    overwrite_freed_blocks_then_let_the_sender_go_on(rig)
    assert_victim_left_nothing_and_the_prompt_stays_exact(rig, tiny_loaded)


# Pool arithmetic for the preemption test (block size 16, budget 16, an 8-block pool): the holder's
# transfer is held on the Gate, so its 4 blocks stay pinned; the victim (80 tokens, 5 blocks) is
# then the only request running, takes one block a step, and its 5th chunk finds the pool full:
# the newest running request, itself, is preempted, with blocks of its transfer still queued.
HOLDER_PROMPT = list(range(900, 964))
VICTIM_PROMPT = [(5 * j) % 300 + 1000 for j in range(80)]


@pytest.mark.parametrize("kind", CHANNELS)
def test_preemption_mid_prefill_aborts_the_transfer(tiny_loaded, kind):
    rig = start_rig(tiny_loaded, kind, rules=(hold("holder"),),
                    prefill_engine=engine_config(num_blocks=8, budget=16))
    try:
        prefill = rig.stub(rig.prefill).Prefill
        holder = prefill.future(rig.prefill_request("holder", HOLDER_PROMPT), timeout=60)
        assert rig.gate.reached.wait(30), "the holder's transfer never reached the gate"
        eventually(lambda: not rig.prefill.engine.has_unfinished(), 10, "P computed the holder's prompt")
        failure = prefill.future(rig.prefill_request("victim", VICTIM_PROMPT), timeout=60).exception(60)
        assert failure is not None and failure.code() is grpc.StatusCode.ABORTED, failure
        assert "preempted" in failure.details()
        eventually(lambda: finished_transfers(rig.decode) == 1, 10, "D ended the victim's transfer")
        assert cached_prompt_blocks(rig.decode, VICTIM_PROMPT) == 0, "D cached blocks of an aborted transfer"
        assert rig.prefill.status().preemptions_total == 0  # the victim never finished: it was dropped

        rig.gate.open()
        reply = holder.result(60)  # the holder's KV was pinned all along: it arrives whole
        tokens, used = rig.decode_tokens("holder", HOLDER_PROMPT, reply)
        assert used and tokens == reference_tokens(tiny_loaded, HOLDER_PROMPT)
        tokens, used = rig.decode_tokens("again", VICTIM_PROMPT)
        assert not used and tokens == reference_tokens(tiny_loaded, VICTIM_PROMPT)
        wait_until_clean(rig.prefill, rig.decode)
        assert_no_wrong_kv(rig.prefill, rig.decode)
    finally:
        rig.gate.open()
        rig.close()


