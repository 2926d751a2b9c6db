"""loadtest.stats: percentiles, per-request latencies, goodput, hit rate, errors, the report."""

from __future__ import annotations

import pytest

from loadtest.stats import (
    SLO,
    build_report,
    errors_by_status,
    meets_slo,
    percentile,
    prefix_hit_rate,
    summarize,
    timeline,
)
from tests.loadtest.records import make_record

# --- percentiles ----------------------------------------------------------------------------------


def test_percentile_interpolates_linearly_between_closest_ranks():
    assert percentile([4, 1, 3, 2], 50) == 2.5  # ranks 1.5 -> halfway between 2 and 3
    assert percentile([10, 20, 30, 40, 50], 90) == pytest.approx(46.0)  # rank 3.6
    assert percentile(list(range(101)), 99) == 99
    assert percentile([10, 20, 30, 40, 50], 0) == 10 and percentile([10, 20, 30, 40, 50], 100) == 50
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None


def test_summarize_gives_p50_p90_p99_mean_max_and_count():
    assert summarize([10, 20, 30, 40, 50]) == {"p50": 30, "p90": 46.0, "p99": 49.6, "mean": 30,
                                               "max": 50, "count": 5}
    assert summarize([]) == {"p50": None, "p90": None, "p99": None, "mean": None, "max": None, "count": 0}


# --- one request ----------------------------------------------------------------------------------


def test_ttft_itl_tpot_and_e2e_from_known_timestamps():
    # sent at 1.0 s; messages at 1.1 (1 token), 1.15 (1 token), 1.25 (2 tokens); stream ends at 1.3
    r = make_record(send=1.0, times=(1.1, 1.15, 1.25), counts=(1, 1, 2), end=1.3)
    assert r.ttft_ms == pytest.approx(100.0)
    # the 100 ms gap before the 2-token message is split evenly: two samples of 50 ms
    assert r.itl_ms == pytest.approx([50.0, 50.0, 50.0])
    assert r.output_tokens == 4
    assert r.e2e_ms == pytest.approx(300.0)
    assert r.tpot_ms == pytest.approx((300.0 - 100.0) / 3)


def test_a_single_token_has_no_itl_and_no_tpot():
    r = make_record(send=0.0, times=(0.2,), end=0.25)
    assert r.itl_ms == [] and r.tpot_ms is None and r.ttft_ms == pytest.approx(200.0)


def test_extra_tokens_of_the_first_message_give_no_itl_samples():
    r = make_record(send=0.0, times=(0.1, 0.2), counts=(3, 1))
    assert r.itl_ms == pytest.approx([100.0]) and r.output_tokens == 4


# --- goodput, hit rate, errors --------------------------------------------------------------------

SLO_200_100 = SLO(ttft_ms=200.0, itl_ms=100.0)


def test_goodput_needs_both_objectives():
    meets_both = make_record(send=0.0, times=(0.1, 0.15, 0.2))  # ttft 100, itl 50, 50
    fails_itl_only = make_record(send=0.0, times=(0.1, 0.15, 0.65))  # ttft 100, itl 50, 500
    fails_ttft_only = make_record(send=0.0, times=(0.3, 0.35, 0.4))  # ttft 300, itl 50, 50
    failed = make_record(times=(0.1,), status="RESOURCE_EXHAUSTED")
    assert meets_slo(meets_both, SLO_200_100)
    assert not meets_slo(fails_itl_only, SLO_200_100)
    assert not meets_slo(fails_ttft_only, SLO_200_100)
    assert not meets_slo(failed, SLO_200_100)

    records = [meets_both, fails_itl_only, fails_ttft_only, failed]
    report = build_report(records, duration_s=2.0, slo=SLO_200_100)
    assert report["goodput"] == {"requests_per_s": 0.5, "requests": 1, "fraction": 0.25}
    assert report["slo"]["itl_criterion"] == "p99"


def test_the_itl_criterion_decides_a_request_with_one_slow_gap():
    # nine 50 ms gaps and one 150 ms gap: p99 ~ 141 ms, max 150 ms, mean 60 ms
    times = [0.1 + 0.05 * i for i in range(10)] + [0.1 + 0.05 * 9 + 0.15]
    r = make_record(send=0.0, times=times)
    assert not meets_slo(r, SLO(200.0, 100.0, "p99"))
    assert not meets_slo(r, SLO(200.0, 100.0, "max"))
    assert meets_slo(r, SLO(200.0, 100.0, "mean"))


def test_a_one_token_reply_meets_the_itl_objective():
    assert meets_slo(make_record(send=0.0, times=(0.1,)), SLO_200_100)


def test_prefix_hit_rate_sums_cached_over_prompt_tokens_of_successful_requests():
    records = [make_record(times=(0.1,), prompt=100, cached=25),
               make_record(times=(0.1,), prompt=300, cached=275),
               make_record(times=(0.1,), status="UNAVAILABLE")]
    assert prefix_hit_rate(records) == pytest.approx(300 / 400)
    assert prefix_hit_rate([make_record(status="INTERNAL")]) is None


def test_errors_are_counted_by_grpc_status_name():
    records = [make_record(times=(0.1,)), make_record(status="RESOURCE_EXHAUSTED"),
               make_record(status="RESOURCE_EXHAUSTED"), make_record(status="UNAVAILABLE")]
    assert errors_by_status(records) == {"RESOURCE_EXHAUSTED": 2, "UNAVAILABLE": 1}


# --- the report -----------------------------------------------------------------------------------


def test_build_report_counts_tokens_and_rates():
    records = [make_record(index=0, send=0.0, times=(0.1, 0.2, 0.3), end=0.5, prompt=100, cached=50),
               make_record(index=1, send=0.5, times=(0.6, 0.7), end=1.0, prompt=100, cached=0),
               make_record(index=2, send=0.5, end=0.6, status="DEADLINE_EXCEEDED", error="too slow")]
    report = build_report(records, duration_s=1.0, slo=SLO(), skipped=1, meta={"seed": 7})
    assert report["seed"] == 7 and report["schema"] == "pdserve.loadtest/1"
    assert report["counts"] == {"sent": 3, "completed": 2, "failed": 1, "skipped": 1}
    assert report["output_tokens_total"] == 5
    assert report["prompt_tokens_total"] == 200 and report["cached_tokens_total"] == 50
    assert report["throughput_tokens_per_s"] == 5.0 and report["requests_per_s"] == 2.0
    assert report["prefix_hit_rate"] == 0.25
    assert report["errors"] == {"DEADLINE_EXCEEDED": 1}
    assert report["error_examples"] == {"DEADLINE_EXCEEDED": "too slow"}
    assert report["ttft_ms"]["count"] == 2 and report["e2e_ms"]["p50"] == 500.0
    assert report["workers"] == {"decode": {"d0": 2}, "prefill": {"": 2}}
    assert report["by_kind"] == {}


def test_by_kind_splits_latencies_when_there_are_several_kinds():
    records = [make_record(send=0.0, times=(0.1,), kind="long"),
               make_record(send=0.0, times=(0.3,), kind="short")]
    by_kind = build_report(records, duration_s=1.0, slo=SLO())["by_kind"]
    assert set(by_kind) == {"long", "short"}
    assert by_kind["long"]["ttft_ms"]["p50"] == 100.0 and by_kind["short"]["ttft_ms"]["p50"] == 300.0


def test_timeline_bins_tokens_per_second_and_cumulative_completions():
    records = [make_record(send=0.0, times=(0.1, 0.2), end=0.3), make_record(send=0.0, times=(1.5,), end=1.9)]
    tl = timeline(records, duration_s=2.0, bins=2)
    assert tl["bin_s"] == 1.0 and tl["t_s"] == [1.0, 2.0]
    assert tl["output_tokens_per_s"] == [2.0, 1.0]
    assert tl["completed"] == [1, 2]
