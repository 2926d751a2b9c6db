"""KV transfer between two processes over a real gRPC socket, with the real model (SmolLM2).

The prefill worker runs here, the decode worker in a process of its own (WorkerProcess): both
are production WorkerServers, called over gRPC, so the KV crosses a socket between two
engines that share nothing. The channel-by-channel contract, faults included, runs on the tiny
model in test_transfer_contract.py.
"""

from __future__ import annotations

import grpc
import pytest

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.sequence import SamplingParams
from pdserve.worker.convert import sampling_to_proto
from pdserve.worker.server import WorkerConfig, WorkerServer
from prefill_worker.faults import FaultKind, FaultPlan, FaultRule, RequestIds
from prefill_worker.role import PrefillConfig, PrefillRole
from protos.pdserve.v1 import worker_pb2, worker_pb2_grpc
from tests.helpers.kv_audit import audit_failures
from tests.helpers.processes import WorkerProcess
from tests.helpers.rig import reference_tokens
from tests.helpers.waiting import eventually
from tests.helpers.workers import wait_until_clean

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
CORRUPTED = "corrupted"  # the one request whose transfer the prefill worker's plan corrupts


@pytest.fixture(scope="module")
def smol_decode():
    process = WorkerProcess(None, role="decode")  # SmolLM2
    yield process
    process.close()


@pytest.fixture(scope="module")
def smol_prefill(smollm_loaded):
    engine = EngineConfig(cache=CacheConfig(num_blocks=256), device="cpu",
                          scheduler=SchedulerConfig(max_num_batched_tokens=64))
    plan = FaultPlan((FaultRule(FaultKind.CORRUPT, RequestIds({CORRUPTED}), at_frame=5),))
    worker = WorkerServer(WorkerConfig("prefill", engine, metrics_port=None),
                          PrefillRole(PrefillConfig(fault_plan=plan)), smollm_loaded)
    worker.start()
    yield worker
    worker.stop()


def chat(loaded, text: str) -> list[int]:
    return loaded.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def remote_prefill(prefill: WorkerServer, decode: WorkerProcess, request_id: str, prompt: list[int],
                   decode_cached_blocks: int = 0) -> worker_pb2.PrefillReply:
    stub = worker_pb2_grpc.PrefillServiceStub(grpc.insecure_channel(prefill.address))
    return stub.Prefill(worker_pb2.PrefillRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling=sampling_to_proto(GREEDY),
        decode_target=decode.address, decode_cached_blocks=decode_cached_blocks), timeout=120)


def decode_tokens(decode: WorkerProcess, request_id: str, prompt: list[int],
                  reply: worker_pb2.PrefillReply | None) -> tuple[list[int], bool]:
    request = worker_pb2.DecodeRequest(request_id=request_id, prompt_token_ids=prompt,
                                       sampling=sampling_to_proto(GREEDY), prefill_here=reply is None)
    if reply is not None:
        request.first_token = reply.first_token
    replies = list(decode.stub.Decode(request, timeout=120))
    return [t for r in replies for t in r.token_ids], replies[0].used_transferred_kv


def assert_process_clean(decode: WorkerProcess) -> None:
    eventually(lambda: (lambda s: (s.used_blocks, s.parked_transfers, s.free_blocks)
                        == (0, 0, s.num_blocks))(decode.status()), 5, "the decode process holds no block")


def test_greedy_tokens_identical_to_one_engine(smollm_loaded, smol_prefill, smol_decode):
    prompts = [chat(smollm_loaded, "What is the capital of France?"),
               chat(smollm_loaded, "Write a haiku about the sea. " * 6),
               list(range(1000, 1017))]
    for i, prompt in enumerate(prompts):
        reply = remote_prefill(smol_prefill, smol_decode, f"x{i}", prompt)
        tokens, used = decode_tokens(smol_decode, f"x{i}", prompt, reply)
        assert used, "the decode process fell back to local prefill"
        assert tokens == reference_tokens(smollm_loaded, prompt, GREEDY)
    wait_until_clean(smol_prefill)
    assert_process_clean(smol_decode)
    assert not audit_failures([smol_prefill.address, smol_decode.address])


def test_receiver_cached_prefix_sends_fewer_bytes(smollm_loaded, smol_prefill, smol_decode):
    system = "You are a careful assistant who answers in one short sentence. " * 4
    first = smollm_loaded.tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": "Name a colour."}])
    second = smollm_loaded.tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": "Name a fruit."}])
    shared_blocks = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b) // 16
    assert shared_blocks >= 2
    cold = remote_prefill(smol_prefill, smol_decode, "c1", first)
    decode_tokens(smol_decode, "c1", first, cold)  # the decode side now caches it
    warm = remote_prefill(smol_prefill, smol_decode, "c2", second, decode_cached_blocks=shared_blocks)
    tokens, used = decode_tokens(smol_decode, "c2", second, warm)
    layers, block_bytes = smollm_loaded.config.num_layers, smol_prefill.layout.block_bytes
    assert cold.bytes_sent == layers * -(-len(first) // 16) * block_bytes
    assert warm.bytes_sent == layers * (-(-len(second) // 16) - shared_blocks) * block_bytes
    assert used and tokens == reference_tokens(smollm_loaded, second, GREEDY)
    wait_until_clean(smol_prefill)
    assert_process_clean(smol_decode)
    assert not audit_failures([smol_prefill.address, smol_decode.address])


def test_flipped_byte_over_grpc_is_detected_and_recompute_is_exact(smollm_loaded, smol_prefill, smol_decode):
    prompt = chat(smollm_loaded, "Tell me about rivers.")
    with pytest.raises(grpc.RpcError) as failure:
        remote_prefill(smol_prefill, smol_decode, CORRUPTED, prompt)
    assert failure.value.code() is grpc.StatusCode.DATA_LOSS
    assert "checksum mismatch" in failure.value.details()
    assert smol_decode.status().transfer_outcomes["DATA_LOSS"] == 1
    assert_process_clean(smol_decode)
    tokens, used = decode_tokens(smol_decode, CORRUPTED, prompt, None)
    assert not used and tokens == reference_tokens(smollm_loaded, prompt, GREEDY)
    wait_until_clean(smol_prefill)
    assert_process_clean(smol_decode)
    assert not audit_failures([smol_prefill.address, smol_decode.address])
