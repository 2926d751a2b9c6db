"""Request limits: the pure checks with worked values, then each one enforced by a real router
(+ two tiny-model workers, real gRPC) with the right status code and a message naming it."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from pdserve.engine.llm_engine import InvalidRequestError
from pdserve.engine.sequence import SamplingParams
from protos.pdserve.v1 import generation_pb2 as pb
from router import limits as lim
from router.limits import LimitExceeded, RequestLimits, StreamLimitReached
from tests.conftest import make_engine
from tests.helpers.cluster import TINY_CONTEXT, greedy, running_cluster
from tests.helpers.workers import wait_until_clean

VOCAB = 49152

# --- pure checks -------------------------------------------------------------------------------


def test_limits_are_validated_when_built():
    assert RequestLimits().max_tokens_limit == 4096 and RequestLimits().max_message_bytes == 4 << 20
    for bad in ({"max_tokens_limit": 0}, {"max_concurrent_streams": -1}, {"max_prompt_tokens": 0},
                {"stream_retry_after_s": float("nan")}):
        with pytest.raises(ValueError, match=f"{next(iter(bad))} must be > 0"):
            RequestLimits(**bad)


def test_prompt_must_fit_the_context_and_the_server_limit():
    limits = RequestLimits()
    lim.check_prompt(511, 512, limits)
    with pytest.raises(LimitExceeded, match=r"prompt has 512 tokens; this model's context is 512 \(the "):
        lim.check_prompt(512, 512, limits)
    lim.check_prompt(10**6, None, limits)  # no context known: the workers still check theirs
    lower = RequestLimits(max_prompt_tokens=300)
    lim.check_prompt(300, 512, lower)
    with pytest.raises(LimitExceeded, match=r"prompt has 301 tokens; this server's limit is 300 "
                                            r"\(--max-prompt-tokens\)"):
        lim.check_prompt(301, 512, lower)
    with pytest.raises(LimitExceeded, match="this model's context is 8,192"):
        lim.check_prompt(9000, 8192, RequestLimits(max_prompt_tokens=10_000))


def test_max_tokens_given_must_fit_the_limit_and_the_context():
    limits = RequestLimits()
    assert lim.resolve_max_tokens(4096, 10, None, limits) == 4096
    with pytest.raises(LimitExceeded) as err:
        lim.resolve_max_tokens(100_000, 10, None, limits)
    assert str(err.value) == "max_tokens 100,000 exceeds this server's limit of 4,096 (--max-tokens-limit)"
    assert lim.resolve_max_tokens(12, 500, 512, limits) == 12
    with pytest.raises(LimitExceeded) as err:
        lim.resolve_max_tokens(20, 500, 512, limits)
    assert str(err.value) == ("prompt (500 tokens) + max_tokens (20) = 520 exceeds this model's context of "
                              "512 tokens; ask for at most 12 new tokens or shorten the prompt")


def test_max_tokens_left_unset_is_the_default_capped_never_an_error():
    assert lim.resolve_max_tokens(None, 10, 512, RequestLimits()) == 128
    assert lim.resolve_max_tokens(None, 500, 512, RequestLimits()) == 12
    assert lim.resolve_max_tokens(None, 10, None, RequestLimits(max_tokens_limit=64)) == 64
    assert lim.resolve_max_tokens(None, 10, None, RequestLimits(default_max_tokens=1000)) == 1000


def test_stop_conditions():
    limits = RequestLimits(max_stop_strings=2, max_stop_string_chars=5, max_stop_token_ids=3)
    lim.check_sampling(SamplingParams(stop=("abcde", "x"), stop_token_ids=(0, 1, VOCAB - 1)), VOCAB, limits)
    cases = [
        (SamplingParams(stop=("a", "b", "c")), "sampling.stop has 3 strings; this server's limit is 2"),
        (SamplingParams(stop=("abcdef",)),
         "a sampling.stop string has 6 characters; this server's limit is 5"),
        (SamplingParams(stop_token_ids=(1, 2, 3, 4)),
         "sampling.stop_token_ids has 4 ids; this server's limit is 3"),
        (SamplingParams(stop_token_ids=(1, VOCAB)),
         f"sampling.stop_token_ids has {VOCAB}, outside the vocabulary [0, {VOCAB})"),
    ]
    for sampling, message in cases:
        with pytest.raises(LimitExceeded) as err:
            lim.check_sampling(sampling, VOCAB, limits)
        assert str(err.value) == message


def test_logprobs_up_to_the_limit_of_20():
    limits = RequestLimits()
    assert limits.max_logprobs == 20
    lim.check_sampling(SamplingParams(logprobs=0), VOCAB, limits)
    lim.check_sampling(SamplingParams(logprobs=20), VOCAB, limits)
    with pytest.raises(LimitExceeded) as err:
        lim.check_sampling(SamplingParams(logprobs=21), VOCAB, limits)
    assert str(err.value) == "sampling.logprobs 21 exceeds this server's limit of 20 top alternatives"


def test_request_id_and_chat_sizes():
    limits = RequestLimits(max_request_id_chars=4, max_chat_messages=2)
    lim.check_request_id("", limits)
    lim.check_request_id("abcd", limits)
    with pytest.raises(LimitExceeded, match="request_id has 5 characters; this server's limit is 4"):
        lim.check_request_id("abcde", limits)
    lim.check_chat(2, limits)
    with pytest.raises(LimitExceeded, match="chat has 3 messages; this server's limit is 2"):
        lim.check_chat(3, limits)


def test_streams_over_the_limit_are_refused_with_a_retry_hint():
    limits = RequestLimits(max_concurrent_streams=2, stream_retry_after_s=0.5)
    lim.check_streams(1, limits)
    with pytest.raises(StreamLimitReached) as err:
        lim.check_streams(2, limits)
    assert err.value.retry_after_s == 0.5
    assert str(err.value) == ("2 Generate streams are in flight; this server's limit is 2 "
                              "(--max-concurrent-streams); retry after 500 ms")


def test_sampling_params_reject_non_finite_and_out_of_range_values():
    nan, inf = float("nan"), float("inf")
    for kwargs, message in [({"temperature": nan}, "temperature"), ({"temperature": inf}, "temperature"),
                            ({"top_p": nan}, "top_p"), ({"top_p": inf}, "top_p"), ({"top_p": 0.0}, "top_p"),
                            ({"seed": 2**64}, "seed"), ({"seed": -1}, "seed"),
                            ({"stop_token_ids": (-1,)}, "stop_token_ids"), ({"stop": ("",)}, "stop")]:
        with pytest.raises(ValueError, match=message):
            SamplingParams(**kwargs)
    SamplingParams(seed=2**64 - 1)


def test_engine_rejects_stop_token_ids_outside_its_vocabulary(tiny_loaded):
    engine = make_engine(tiny_loaded, num_blocks=8)
    with pytest.raises(InvalidRequestError, match=f"stop_token_ids has {VOCAB}, outside the vocabulary"):
        engine.add_request([1, 2, 3], SamplingParams(stop_token_ids=(VOCAB,)))


# --- enforced by a real router -----------------------------------------------------------------

LIMITS = RequestLimits(max_prompt_tokens=200, max_tokens_limit=300, max_message_bytes=32 << 10,
                       max_concurrent_streams=2, max_chat_messages=8, max_stop_strings=2,
                       max_request_id_chars=16, stream_retry_after_s=0.25)


@pytest.fixture(scope="module")
def cluster(tiny_loaded):
    with running_cluster(tiny_loaded, LIMITS) as c:
        yield c


def call(cluster, timeout: float = 30, **kwargs) -> list[pb.GenerateResponse]:
    return list(cluster.stub.Generate(pb.GenerateRequest(**kwargs), timeout=timeout))


def ids(n: int, start: int = 1000) -> pb.TokenIds:
    return pb.TokenIds(ids=list(range(start, start + n)))


@pytest.mark.parametrize("kwargs, message", [
    ({"token_ids": ids(201)}, "prompt has 201 tokens; this server's limit is 200 (--max-prompt-tokens)"),
    ({"token_ids": ids(10), "sampling": greedy(301)},
     "max_tokens 301 exceeds this server's limit of 300 (--max-tokens-limit)"),
    ({"token_ids": ids(10), "sampling": greedy(10**6)},
     "max_tokens 1,000,000 exceeds this server's limit of 300 (--max-tokens-limit)"),
    ({"chat": pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")] * 9)},
     "chat has 9 messages; this server's limit is 8"),
    ({"text": "hi", "sampling": pb.SamplingParams(stop=["a", "b", "c"])},
     "sampling.stop has 3 strings; this server's limit is 2"),
    ({"text": "hi", "sampling": pb.SamplingParams(stop_token_ids=[VOCAB])},
     f"sampling.stop_token_ids has {VOCAB}, outside the vocabulary"),
    ({"text": "hi", "request_id": "r" * 17}, "request_id has 17 characters; this server's limit is 16"),
    ({"text": "hi", "sampling": pb.SamplingParams(logprobs=21)},
     "sampling.logprobs 21 exceeds this server's limit of 20 top alternatives"),
    ({"text": "hi", "sampling": pb.SamplingParams(temperature=float("nan"))}, "temperature must be >= 0"),
    ({"text": "hi", "sampling": pb.SamplingParams(top_p=float("inf"))}, "top_p must be in (0, 1]"),
    ({"text": "hi", "routing": "prefix", "routing_weights": {"prefill": float("nan")}},
     "routing weight prefill must be a finite number >= 0, got nan"),
    ({"text": "hi", "routing_weights": {"local_prefill_max_tokens": float("inf")}},
     "routing weight local_prefill_max_tokens must be a finite number >= 0, got inf"),
])
def test_each_limit_is_invalid_argument_naming_it(cluster, kwargs, message):
    with pytest.raises(grpc.RpcError) as err:
        call(cluster, **kwargs)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()


def test_prompt_plus_max_tokens_over_the_context_is_invalid_argument(tiny_loaded):
    with running_cluster(tiny_loaded, RequestLimits()) as c:
        with pytest.raises(grpc.RpcError) as err:
            call(c, token_ids=ids(500), sampling=greedy(13))
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert ("prompt (500 tokens) + max_tokens (13) = 513 exceeds this model's context of 512 tokens; "
                "ask for at most 12 new tokens") in err.value.details()
        replies = call(c, token_ids=ids(500), sampling=greedy(12))
        assert replies[-1].usage.completion_tokens == 12
        with pytest.raises(grpc.RpcError) as err:
            call(c, token_ids=ids(512))
        assert f"prompt has 512 tokens; this model's context is {TINY_CONTEXT}" in err.value.details()


def test_max_tokens_left_unset_is_the_default(cluster):
    sampling = pb.SamplingParams(temperature=0, ignore_eos=True)  # no max_tokens: 128
    replies = call(cluster, token_ids=ids(150), sampling=sampling)
    assert replies[-1].finished and replies[-1].finish_reason == "length"
    assert replies[-1].usage.completion_tokens == 128


def test_a_message_over_max_message_bytes_is_resource_exhausted(cluster):
    with pytest.raises(grpc.RpcError) as err:
        call(cluster, text="x" * (32 << 10))
    assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in err.value.details()
    assert call(cluster, text="x" * 100, sampling=greedy(2))[-1].finished  # the server carries on


def test_streams_over_the_limit_are_refused_at_once_then_admitted_again(cluster):
    """max_concurrent_streams=2: two slow streams in flight (300 tokens each, over a second on
    the tiny model), a third is refused immediately; once they finish a new one succeeds."""
    slow = [cluster.stub.Generate(pb.GenerateRequest(token_ids=ids(50, 2000 + 100 * i), sampling=greedy(300)),
                                  timeout=60) for i in range(2)]
    firsts = [next(s) for s in slow]  # both are streaming: each holds one of the two slots
    assert all(not f.finished for f in firsts)
    assert cluster.router.servicer.requests_in_flight == 2
    started = time.perf_counter()
    with pytest.raises(grpc.RpcError) as err:
        call(cluster, text="hi", sampling=greedy(2))
    assert time.perf_counter() - started < 1.0
    assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.value.details() == ("2 Generate streams are in flight; this server's limit is 2 "
                                   "(--max-concurrent-streams); retry after 250 ms")
    assert ("retry-after-ms", "250") in tuple(err.value.trailing_metadata())
    rest = [list(s) for s in slow]
    assert all(r[-1].finished and r[-1].usage.completion_tokens == 300 for r in rest)
    deadline = time.monotonic() + 5
    while cluster.router.servicer.requests_in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert call(cluster, text="hi", sampling=greedy(2))[-1].finished
    wait_until_clean(*cluster.workers, timeout_s=10.0)


def test_two_clients_may_use_the_same_request_id_at_once(cluster):
    """Workers see a router-made id, so equal client ids do not collide in a worker's engine or
    KV sender; each client gets its own id back."""
    results: list[list[pb.GenerateResponse]] = []

    def one(start: int) -> None:
        results.append(call(cluster, request_id="same", token_ids=ids(48, start), sampling=greedy(16)))

    threads = [threading.Thread(target=one, args=(3000 + 100 * i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(results) == 2
    for replies in results:
        assert replies[-1].finished and replies[-1].usage.completion_tokens == 16
        assert {r.request_id for r in replies} == {"same"}
        assert replies[-1].prefill_worker  # 48 tokens: the remote-prefill path, through the KV sender
    wait_until_clean(*cluster.workers, timeout_s=10.0)
