"""Router + two real workers in one process over real gRPC sockets (tiny model: tests/helpers/cluster.py)."""

from __future__ import annotations

import grpc
import pytest

from pdserve.engine.sequence import SamplingParams
from protos.pdserve.v1 import generation_pb2
from tests.conftest import MIN_GREEDY_MARGIN, greedy_margin, make_engine
from tests.helpers.cluster import generate, generate_request, running_cluster
from tests.helpers.workers import wait_until_clean


@pytest.fixture(scope="module")
def cluster(tiny_loaded):
    with running_cluster(tiny_loaded) as c:
        yield c.router, c.workers


@pytest.mark.parametrize("prompt_len, remote", [(50, True), (10, False)])
def test_both_paths_match_one_engine(cluster, tiny_loaded, prompt_len, remote):
    router, workers = cluster
    prompt = list(range(700, 700 + prompt_len))
    replies = generate(router, generate_request(prompt))
    tokens = [t for r in replies for t in r.token_ids]
    expected = make_engine(tiny_loaded).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), detokenize=False)[0]
    assert tokens == expected.token_ids
    last = replies[-1]
    assert last.finished and last.usage.completion_tokens == 8 and last.usage.prompt_tokens == prompt_len
    assert bool(last.prefill_worker) is remote
    wait_until_clean(*workers, timeout_s=0)


@pytest.mark.parametrize("prompt_len, remote", [(50, True), (10, False)])
def test_logprobs_arrive_for_every_token_including_the_first(cluster, tiny_loaded, prompt_len, remote):
    """On the remote path the first token's logprob is computed on the prefill worker, where it was
    sampled, and rides PrefillReply -> DecodeRequest -> the first DecodeReply; the decode engine
    computes the others. Either way they equal one engine's, token for token."""
    router, workers = cluster
    prompt = list(range(1200 if remote else 1300, (1200 if remote else 1300) + prompt_len))
    request = generate_request(prompt)
    request.sampling.logprobs = 3
    replies = generate(router, request)
    assert bool(replies[-1].prefill_worker) is remote
    assert all(len(r.logprobs) == len(r.token_ids) for r in replies)
    got = [lp for r in replies for lp in r.logprobs]
    assert [lp.token_id for lp in got] == [t for r in replies for t in r.token_ids]
    engine = make_engine(tiny_loaded)
    assert greedy_margin(engine, prompt, 8) > MIN_GREEDY_MARGIN  # batch shapes cannot flip a token
    sampling = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    expected = engine.generate([prompt], sampling, detokenize=False)[0]
    assert [lp.token_id for lp in got] == expected.token_ids
    for lp, want in zip(got, expected.logprobs, strict=True):
        assert abs(lp.logprob - want.logprob) <= 1e-4
        assert len(lp.top) == 3 and lp.top[0].token_id == lp.token_id
        assert [t.logprob for t in lp.top] == pytest.approx([v for _, v in want.top], abs=1e-4)
    wait_until_clean(*workers, timeout_s=0)


def test_bad_requests_are_invalid_argument(cluster):
    router, _ = cluster
    cases = [
        ({}, "prompt is missing"),
        ({"token_ids": generation_pb2.TokenIds(ids=[])}, "prompt is empty"),
        ({"token_ids": generation_pb2.TokenIds(ids=[1, 10**6])}, "outside the vocabulary"),
        ({"text": "hi", "sampling": generation_pb2.SamplingParams(max_tokens=0)}, "max_tokens must be >= 1"),
        ({"text": "hi", "sampling": generation_pb2.SamplingParams(top_p=1.5)}, "top_p"),
        ({"text": "hi", "sampling": generation_pb2.SamplingParams(temperature=-1)}, "temperature"),
        ({"chat": generation_pb2.ChatMessages(messages=[generation_pb2.ChatMessage(role="x")])}, "role"),
    ]
    for kwargs, message in cases:
        with pytest.raises(grpc.RpcError) as err:
            generate(router, generation_pb2.GenerateRequest(**kwargs))
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT, kwargs
        assert message in err.value.details()
