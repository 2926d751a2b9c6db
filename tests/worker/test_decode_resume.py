"""The decode worker's resume path trusts nothing: every field of a Decode call that resumes
transferred KV is checked against the KV parked for it, and a bad one is INVALID_ARGUMENT that
frees the parked KV. Two tiny-model WorkerServers over real gRPC (tests/helpers/rig.py)."""

from __future__ import annotations

import grpc
import pytest

from pdserve.engine.sequence import SamplingParams
from pdserve.worker.convert import sampling_to_proto
from protos.pdserve.v1 import worker_pb2
from tests.helpers.rig import GREEDY, reference_tokens, start_rig
from tests.helpers.workers import wait_until_clean

PROMPT = list(range(300, 350))


@pytest.fixture(scope="module")
def rig(tiny_loaded):
    rig = start_rig(tiny_loaded, "grpc")
    yield rig
    rig.close()


def bad_top_p(request: worker_pb2.DecodeRequest) -> None:
    request.sampling.top_p = 2.0


def bad_stop_token(request: worker_pb2.DecodeRequest) -> None:
    request.sampling.stop_token_ids.append(10**7)


def other_prompt(request: worker_pb2.DecodeRequest) -> None:
    request.prompt_token_ids[7] += 1


def shorter_prompt(request: worker_pb2.DecodeRequest) -> None:
    del request.prompt_token_ids[-1]


def first_token_out_of_range(request: worker_pb2.DecodeRequest) -> None:
    request.first_token = 10**7


def generated_tokens_the_transfer_lacks(request: worker_pb2.DecodeRequest) -> None:
    request.generated_token_ids.extend([5, 6])  # a continuation of a prompt whose KV ends before them


def logprobs_asked_only_at_decode(request: worker_pb2.DecodeRequest) -> None:
    request.sampling.logprobs = 2  # the prefill worker was not asked: it sent no first_logprob


def a_first_logprob_nobody_asked_for(request: worker_pb2.DecodeRequest) -> None:
    request.first_logprob.token_id, request.first_logprob.logprob = request.first_token, -0.5


@pytest.mark.parametrize("spoil, message", [
    (first_token_out_of_range, "first_token 10000000 is outside the vocabulary"),
    (other_prompt, "differ from the prompt whose KV was transferred"),
    (shorter_prompt, "prompt_token_ids (49 tokens) differ"),
    (generated_tokens_the_transfer_lacks, "prompt_token_ids + generated_token_ids (52 tokens) differ"),
    (bad_top_p, "top_p must be in (0, 1]"),
    (bad_stop_token, "sampling.stop_token_ids has 10000000"),
    (logprobs_asked_only_at_decode, "first_logprob is missing but sampling.logprobs is 2"),
    (a_first_logprob_nobody_asked_for, "first_logprob is given but sampling.logprobs is None"),
])
def test_a_bad_field_is_invalid_argument_and_frees_the_parked_kv(rig, tiny_loaded, spoil, message):
    rid = f"bad-{spoil.__name__}"
    reply = rig.remote_prefill(rid, PROMPT)
    assert rig.decode.status().parked_transfers == 1
    request = worker_pb2.DecodeRequest(request_id=rid, prompt_token_ids=PROMPT, first_token=reply.first_token,
                                       sampling=sampling_to_proto(GREEDY))
    spoil(request)
    with pytest.raises(grpc.RpcError) as failure:
        list(rig.stub(rig.decode).Decode(request, timeout=30))
    assert failure.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert message in failure.value.details()
    wait_until_clean(rig.prefill, rig.decode, timeout_s=0.5)
    # the worker still serves: the same prompt, transferred again, resumes exactly
    again = rig.remote_prefill(f"{rid}-again", PROMPT)
    tokens, used = rig.decode_tokens(f"{rid}-again", PROMPT, again)
    assert used and tokens == reference_tokens(tiny_loaded, PROMPT)
    wait_until_clean(rig.prefill, rig.decode)


def test_an_empty_request_id_is_invalid_argument(rig):
    request = worker_pb2.DecodeRequest(request_id="", prompt_token_ids=PROMPT, prefill_here=True,
                                       sampling=sampling_to_proto(SamplingParams(max_tokens=2)))
    with pytest.raises(grpc.RpcError) as failure:
        list(rig.stub(rig.decode).Decode(request, timeout=30))
    assert failure.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "request_id is empty" in failure.value.details()
    with pytest.raises(grpc.RpcError) as failure:
        rig.remote_prefill("", PROMPT)
    assert failure.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "request_id is empty" in failure.value.details()
    wait_until_clean(rig.prefill, rig.decode)
