"""loadtest.runner against a real gRPC server in this process (tests/loadtest/fake_router.py)."""

from __future__ import annotations

import random
import time

import pytest

from loadtest.arrivals import Bounds, ClosedLoop, Poisson, scheduled_offsets
from loadtest.report import format_summary
from loadtest.runner import LoadTestConfig, RequestOptions, run_loadtest
from loadtest.stats import SLO
from loadtest.workloads import MultiTurn, Synthetic
from tests.loadtest.fake_router import CACHED_TOKENS, PROMPT_TOKENS, FakeRouter, reply_text, serving

SMALL = Synthetic(input_tokens=8, output_tokens=5)


def index_of(request) -> int:
    return int(request.request_id.rsplit("-", 1)[1])


def config(target: str, **overrides) -> LoadTestConfig:
    fields = {"router": target, "workload": SMALL, "arrivals": ClosedLoop(2), "bounds": Bounds(8),
              "connect_timeout_s": 5.0, "options": RequestOptions(timeout_s=10.0)}
    return LoadTestConfig(**{**fields, **overrides})


def test_closed_loop_counts_errors_and_never_exceeds_its_concurrency():
    fake = FakeRouter(fail_if=lambda request: index_of(request) % 4 == 3)
    with serving(fake) as s:
        report = run_loadtest(config(s.target, arrivals=ClosedLoop(3), bounds=Bounds(12)))
    assert len(fake.requests) == 12
    assert 2 <= fake.max_in_flight <= 3
    assert report["counts"] == {"sent": 12, "completed": 9, "failed": 3, "skipped": 0}
    assert report["errors"] == {"RESOURCE_EXHAUSTED": 3}
    assert "no KV blocks free" in report["error_examples"]["RESOURCE_EXHAUSTED"]
    assert report["output_tokens_total"] == 9 * 5
    assert report["prompt_tokens_total"] == 9 * PROMPT_TOKENS
    assert report["prefix_hit_rate"] == CACHED_TOKENS / PROMPT_TOKENS
    assert report["itl_ms"]["count"] == 9 * 4 and report["tpot_ms"]["count"] == 9
    assert report["workers"] == {"decode": {"d0": 9}, "prefill": {"p0": 9}}
    assert report["stopped_by"] == "requests"
    assert report["arrival"] == {"mode": "closed_loop", "concurrency": 3}


def test_requests_carry_the_workload_and_the_request_options():
    fake = FakeRouter()
    with serving(fake) as s:
        options = RequestOptions(temperature=0.5, ignore_eos=True, routing="round_robin", timeout_s=10.0)
        run_loadtest(config(s.target, bounds=Bounds(3), options=options, seed=4))
    request = sorted(fake.requests, key=index_of)[0]
    assert request.request_id == "loadtest-4-0"
    assert request.sampling.max_tokens == 5 and request.sampling.ignore_eos
    assert request.sampling.temperature == 0.5 and request.routing == "round_robin"
    assert len(request.chat.messages[0].content.split()) == 8


def test_a_rate_run_stops_at_the_request_count():
    fake = FakeRouter()
    with serving(fake) as s:
        report = run_loadtest(config(s.target, arrivals=Poisson(float("inf")), bounds=Bounds(5)))
    assert len(fake.requests) == 5 and report["counts"]["completed"] == 5
    assert fake.max_in_flight >= 2  # all five were sent at once


def test_a_rate_run_stops_at_the_duration():
    fake = FakeRouter()
    bounds = Bounds(10_000, duration_s=0.5)
    expected = len(scheduled_offsets(40.0, random.Random("0/arrivals"), bounds))
    with serving(fake) as s:
        start = time.monotonic()
        report = run_loadtest(config(s.target, arrivals=Poisson(40.0), bounds=bounds))
        elapsed = time.monotonic() - start
    assert 5 < expected < 60
    assert report["counts"]["sent"] == expected == len(fake.requests)
    assert report["stopped_by"] == "duration" and elapsed < 3.0


def test_a_closed_loop_starts_nothing_after_the_duration():
    fake = FakeRouter()
    with serving(fake) as s:
        report = run_loadtest(config(s.target, bounds=Bounds(10_000, duration_s=0.3)))
    assert 2 <= report["counts"]["sent"] < 10_000 and report["stopped_by"] == "duration"
    assert report["counts"]["sent"] == len(fake.requests)


def test_multi_turn_sends_each_turn_after_the_reply_before_and_includes_it():
    fake = FakeRouter()
    workload = MultiTurn(turns=3, turn_tokens=4, output_tokens=3)
    with serving(fake) as s:
        run_loadtest(config(s.target, workload=workload, arrivals=ClosedLoop(4), bounds=Bounds(6)))
    by_index = {index_of(r): r for r in fake.requests}
    assert sorted(by_index) == list(range(6))
    # 2 conversations, round robin: indexes 0, 1 are turn 0; 2, 3 turn 1; 4, 5 turn 2
    for index, turn in ((2, 1), (3, 1), (4, 2), (5, 2)):
        messages = list(by_index[index].chat.messages)
        previous = index - 2
        assert len(messages) == 2 * turn + 1
        assert messages[-2].role == "assistant"
        assert messages[-2].content == reply_text(f"loadtest-0-{previous}")
        assert list(by_index[previous].chat.messages) == messages[:-2]


def test_multi_turn_records_that_a_turn_waited_for_the_previous_reply():
    fake = FakeRouter()
    workload = MultiTurn(turns=2, turn_tokens=4, output_tokens=3)
    with serving(fake) as s:
        report = run_loadtest(config(s.target, workload=workload, arrivals=Poisson(float("inf")),
                                     bounds=Bounds(4)))
    assert report["counts"]["completed"] == 4
    assert fake.max_in_flight == 2  # the second turns waited for the first


def test_a_failed_turn_skips_the_rest_of_its_conversation():
    fake = FakeRouter(fail_if=lambda request: request.request_id == "loadtest-0-0")
    workload = MultiTurn(turns=3, turn_tokens=4, output_tokens=3)
    with serving(fake) as s:
        report = run_loadtest(config(s.target, workload=workload, bounds=Bounds(6)))
    assert report["counts"] == {"sent": 4, "completed": 3, "failed": 1, "skipped": 2}
    assert sorted(index_of(r) for r in fake.requests) == [0, 1, 3, 5]  # conversation 1 only after 0


def test_messages_with_several_tokens_give_evenly_divided_itl():
    fake = FakeRouter(tokens_per_message=2, token_sleep_s=0.02)
    with serving(fake) as s:
        report = run_loadtest(config(s.target, workload=Synthetic(input_tokens=4, output_tokens=6),
                                     bounds=Bounds(2), arrivals=ClosedLoop(1)))
    assert report["output_tokens_total"] == 12
    assert report["itl_ms"]["count"] == 2 * 4  # 3 messages of 2 tokens: the last two give 2 samples each
    assert 5 <= report["itl_ms"]["p50"] <= 30  # a 20 ms gap split over 2 tokens: ~10 ms each


def test_server_metrics_are_the_deltas_of_the_router_counters():
    fake = FakeRouter(fail_if=lambda request: index_of(request) == 1)
    fake.requests_total.labels("OK").inc(100)  # traffic from before the run
    fake.prompt_tokens.inc(5000)
    with serving(fake, metrics=True) as s:
        report = run_loadtest(config(s.target, metrics_url=s.metrics_url, bounds=Bounds(4)))
    assert report["server_metrics"] == {
        "url": s.metrics_url, "error": None,
        "pdserve_router_requests_total": {"OK": 3.0, "RESOURCE_EXHAUSTED": 1.0},
        "pdserve_router_prompt_tokens_total": 3.0 * PROMPT_TOKENS,
        "pdserve_router_cached_tokens_total": 3.0 * CACHED_TOKENS,
        "pdserve_router_generated_tokens_total": 3.0 * 5}
    assert report["server_metrics"]["pdserve_router_prompt_tokens_total"] == report["prompt_tokens_total"]
    assert "requests {OK 3, RESOURCE_EXHAUSTED 1}, prompt_tokens 300" in format_summary(report)


def test_an_unreachable_metrics_url_is_recorded_and_the_run_goes_on():
    fake = FakeRouter()
    with serving(fake) as s:
        report = run_loadtest(config(s.target, metrics_url="http://127.0.0.1:9/metrics", bounds=Bounds(2)))
    assert report["counts"]["completed"] == 2
    assert "failed" in report["server_metrics"]["error"]


def test_an_unreachable_router_fails_fast_with_a_hint():
    with pytest.raises(ValueError, match="cannot reach the router at 127.0.0.1:9 .*pdserve up"):
        run_loadtest(config("127.0.0.1:9", connect_timeout_s=0.5))


def test_goodput_uses_the_slo():
    fake = FakeRouter(token_sleep_s=0.03)
    with serving(fake) as s:
        strict = run_loadtest(config(s.target, bounds=Bounds(2), slo=SLO(ttft_ms=1.0, itl_ms=1.0)))
        loose = run_loadtest(config(s.target, bounds=Bounds(2), slo=SLO(ttft_ms=5000.0, itl_ms=5000.0)))
    assert strict["goodput"]["requests"] == 0 and loose["goodput"]["requests"] == 2
