"""The load generator over OpenAI's HTTP API (--api openai), against tests/loadtest/fake_openai.py;
and the contract both transports share: the same workload gives the same report."""

from __future__ import annotations

import itertools

import pytest

from loadtest.arrivals import Bounds, ClosedLoop
from loadtest.runner import LoadTestConfig, RequestOptions, run_loadtest
from loadtest.workloads import MultiTurn, SharedPrefix, Synthetic
from pdserve.security import SecurityConfig
from tests.loadtest.fake_openai import MODEL, FakeOpenAI, serving_openai
from tests.loadtest.fake_router import CACHED_TOKENS, PROMPT_TOKENS, FakeRouter, serving

SMALL = Synthetic(input_tokens=8, output_tokens=5)


def config(url: str, **overrides) -> LoadTestConfig:
    fields = {"api": "openai", "url": url, "workload": SMALL, "arrivals": ClosedLoop(2), "bounds": Bounds(8),
              "connect_timeout_s": 5.0, "options": RequestOptions(timeout_s=10.0)}
    return LoadTestConfig(**{**fields, **overrides})


def test_a_closed_loop_over_http_counts_tokens_cached_tokens_workers_and_429s():
    calls = itertools.count()
    fake = FakeOpenAI(fail_if=lambda body: next(calls) % 4 == 3)
    with serving_openai(fake) as url:
        report = run_loadtest(config(url, arrivals=ClosedLoop(3), bounds=Bounds(12)))
    assert len(fake.bodies) == 12 and 2 <= fake.max_in_flight <= 3
    assert report["counts"] == {"sent": 12, "completed": 9, "failed": 3, "skipped": 0}
    assert report["errors"] == {"HTTP 429": 3}
    assert report["output_tokens_total"] == 9 * 5
    assert report["prompt_tokens_total"] == 9 * PROMPT_TOKENS
    assert report["prefix_hit_rate"] == CACHED_TOKENS / PROMPT_TOKENS
    assert report["itl_ms"]["count"] == 9 * 4 and report["tpot_ms"]["count"] == 9
    assert report["workers"] == {"decode": {"d0": 9}, "prefill": {"p0": 9}}
    assert report["api"] == "openai" and report["router"] == url
    assert set(report["server_timings_ms"]) == {"queue_ms", "prefill_ms", "transfer_ms", "ttft_ms"}


def test_refusals_keep_the_openai_message_and_retry_after():
    fake = FakeOpenAI(fail_if=lambda body: True)
    with serving_openai(fake) as url:
        report = run_loadtest(config(url, bounds=Bounds(2)))
    assert report["errors"] == {"HTTP 429": 2}
    assert report["error_examples"]["HTTP 429"] == ("rate_limit_error: fake server: no KV blocks free "
                                                    "(Retry-After: 2)")


def test_each_request_is_a_streamed_chat_completion_with_the_options_and_the_served_model():
    fake = FakeOpenAI(models=("other", MODEL))
    options = RequestOptions(temperature=0.5, top_p=0.8, top_k=7, sampling_seed=3, stop=("END",),
                             timeout_s=10.0)
    with serving_openai(fake) as url:
        run_loadtest(config(url, bounds=Bounds(1), options=options, model=MODEL))
    (body,) = fake.bodies
    assert fake.paths == ["/v1/chat/completions"]
    assert body["model"] == MODEL and body["stream"] and body["stream_options"] == {"include_usage": True}
    assert (body["max_tokens"], body["temperature"], body["top_p"], body["top_k"], body["seed"],
            body["stop"], body["ignore_eos"]) == (5, 0.5, 0.8, 7, 3, ["END"], True)
    assert len(body["messages"][0]["content"].split()) == 8


def test_token_id_prompts_go_to_completions_and_the_first_listed_model_is_the_default():
    fake = FakeOpenAI(models=("first", "second"))
    with serving_openai(fake) as url:
        report = run_loadtest(config(url, workload=Synthetic(input_tokens=6, output_tokens=3, token_ids=True),
                                     bounds=Bounds(2)))
    assert fake.paths == ["/v1/completions"] * 2 and report["counts"]["completed"] == 2
    assert all(b["model"] == "first" and len(b["prompt"]) == 6 for b in fake.bodies)
    assert all(isinstance(t, int) for t in fake.bodies[0]["prompt"])


def test_multi_turn_over_http_sends_the_streamed_reply_text_back_as_the_assistant_message():
    fake = FakeOpenAI()
    workload = MultiTurn(turns=3, turn_tokens=4, output_tokens=3)
    with serving_openai(fake) as url:
        report = run_loadtest(config(url, workload=workload, arrivals=ClosedLoop(4), bounds=Bounds(6)))
    assert report["counts"]["completed"] == 6
    for body in fake.bodies:
        messages = body["messages"]
        for i, m in enumerate(messages):
            if m["role"] == "assistant":  # the reply to the request that sent exactly what came before
                (earlier,) = [j for j, b in enumerate(fake.bodies) if b["messages"] == messages[:i]]
                assert m["content"] == fake.replies[earlier] == f"reply{earlier} t1 t2"
    assert sorted(len(b["messages"]) for b in fake.bodies) == [1, 1, 3, 3, 5, 5]


def test_the_api_token_goes_in_the_authorization_header_and_a_refused_one_fails_fast():
    fake = FakeOpenAI(api_token="s3cret")
    with serving_openai(fake) as url:
        report = run_loadtest(config(url, bounds=Bounds(2), security=SecurityConfig(api_tokens=("s3cret",))))
        assert report["counts"]["completed"] == 2 and fake.authorizations == ["Bearer s3cret"] * 2
        with pytest.raises(ValueError, match="refused .*401.*--api-token-file"):
            run_loadtest(config(url, security=SecurityConfig(api_tokens=("wrong",))))


def test_the_router_metrics_are_scraped_from_the_same_base_url():
    fake = FakeOpenAI()
    fake.requests_total.labels("OK").inc(100)  # traffic from before the run
    with serving_openai(fake) as url:
        report = run_loadtest(config(url + "/v1", bounds=Bounds(3)))  # the SDK's base_url form is fine
    assert report["server_metrics"]["url"] == url + "/metrics"
    assert report["server_metrics"]["pdserve_router_requests_total"] == {"OK": 3.0}
    assert report["server_metrics"]["pdserve_router_generated_tokens_total"] == report["output_tokens_total"]


def test_an_unknown_model_or_an_unreachable_url_fails_fast_with_a_hint():
    with serving_openai(FakeOpenAI()) as url:
        with pytest.raises(ValueError, match="does not serve model 'nope'; it lists fake-model"):
            run_loadtest(config(url, model="nope"))
    with pytest.raises(ValueError, match="cannot reach the HTTP API at http://127.0.0.1:9 .*--http-port"):
        run_loadtest(config("http://127.0.0.1:9", connect_timeout_s=0.5))


def test_grpc_only_settings_are_refused_with_openai():
    with pytest.raises(ValueError, match="--routing is a field of pdserve's gRPC API"):
        config("http://127.0.0.1:9", options=RequestOptions(routing="round_robin"))
    with pytest.raises(ValueError, match="--api openai needs --url"):
        LoadTestConfig(api="openai")


COMPARED = ("counts", "output_tokens_total", "prompt_tokens_total", "cached_tokens_total", "prefix_hit_rate",
            "errors", "workers", "output_tokens_per_request", "prompt_tokens_per_request", "workload", "seed")


def test_the_same_workload_gives_the_same_report_over_grpc_and_over_http():
    workload = SharedPrefix(system_prompt_tokens=20, question_tokens=4, output_tokens=4)
    common = {"workload": workload, "bounds": Bounds(6), "arrivals": ClosedLoop(2), "seed": 3}
    fake_router, fake_http = FakeRouter(), FakeOpenAI()
    with serving(fake_router) as s, serving_openai(fake_http) as url:
        over_grpc = run_loadtest(LoadTestConfig(router=s.target, **common))
        over_http = run_loadtest(config(url, **common))
    assert {k: over_grpc[k] for k in COMPARED} == {k: over_http[k] for k in COMPARED}
    assert over_grpc["itl_ms"]["count"] == over_http["itl_ms"]["count"] == 6 * 3
    sent_grpc = sorted([(m.role, m.content) for m in r.chat.messages] for r in fake_router.requests)
    sent_http = sorted([(m["role"], m["content"]) for m in b["messages"]] for b in fake_http.bodies)
    assert sent_grpc == sent_http
