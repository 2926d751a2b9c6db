"""bench/outside_client.py's pure parts, without AIPerf or a cluster: both tools are asked for the
same workload, each tool's export is read under the right definitions, the referee's arithmetic."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.outside_client import (
    MultiTurn,
    SharedPrefix,
    Target,
    aiperf_command,
    aiperf_figures,
    compare,
    cpu_in_window,
    histogram_totals,
    loadtest_command,
    loadtest_figures,
    median_figures,
    server_figures,
)
from loadtest import cli
from loadtest import workloads as lw
from loadtest.arrivals import ClosedLoop
from loadtest.stats import SLO, build_report
from tests.loadtest.records import make_record

TARGET = Target("http://127.0.0.1:8000", "SmolLM2-135M-Instruct", concurrency=3)


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def loadtest_config(command: list[str]):
    assert command[1:3] == ["-m", "loadtest"]
    return cli.config_from_args(cli.build_parser().parse_args(command[3:]))


def test_shared_prefix_asks_both_tools_for_one_shared_system_prompt_and_the_same_lengths_and_load():
    w = SharedPrefix(system_prompt_tokens=200, question_tokens=20, output_tokens=24, requests=10)
    a = aiperf_command(Path("aiperf"), TARGET, Path("tok"), w, seed=7, out_dir=Path("out"))
    assert [flag(a, f) for f in ("--shared-system-prompt-length", "--isl", "--isl-stddev", "--osl",
                                 "--request-count", "--concurrency", "--random-seed", "--tokenizer")] == \
        ["200", "20", "0", "24", "10", "3", "7", "tok"]
    assert {"--streaming", "--use-server-token-count", "ignore_eos:true", "temperature:0"} <= set(a)
    assert (flag(a, "--endpoint-type"), flag(a, "--model"), flag(a, "--url")) == \
        ("chat", TARGET.model, TARGET.url)
    config = loadtest_config(loadtest_command(TARGET, w, seed=7, out_dir=Path("out")))
    assert config.workload == lw.SharedPrefix(system_prompt_tokens=200, num_prefixes=1, question_tokens=20,
                                              output_tokens=24)
    assert (config.api, config.url, config.model, config.seed) == ("openai", TARGET.url, TARGET.model, 7)
    assert config.bounds.requests == 10 and config.arrivals == ClosedLoop(3)
    assert config.options.temperature == 0 and config.options.ignore_eos


def test_multi_turn_asks_both_for_k_conversations_of_t_turns():
    w = MultiTurn(conversations=3, turns=5, turn_tokens=40, output_tokens=8)
    a = aiperf_command(Path("aiperf"), TARGET, Path("tok"), w, seed=1, out_dir=Path("out"))
    assert [flag(a, f) for f in ("--conversation-num", "--conversation-turn-mean",
                                 "--conversation-turn-stddev", "--conversation-turn-delay-mean", "--isl",
                                 "--osl")] == \
        ["3", "5", "0", "0", "40", "8"]
    config = loadtest_config(loadtest_command(TARGET, w, seed=1, out_dir=Path("out")))
    assert config.workload == lw.MultiTurn(turns=5, turn_tokens=40, output_tokens=8)
    assert config.bounds.requests == 15 == w.requests


def test_an_api_token_goes_to_both_tools_by_the_variable_that_holds_it(monkeypatch):
    monkeypatch.setenv("BENCH_TOKEN", "s3cret")
    target = Target(TARGET.url, TARGET.model, 1, token_env="BENCH_TOKEN")
    command = aiperf_command(Path("a"), target, Path("t"), SharedPrefix(), 0, Path("o"))
    assert flag(command, "--api-key") == "s3cret"
    assert flag(loadtest_command(target, SharedPrefix(), 0, Path("o")), "--api-token-env") == "BENCH_TOKEN"


def test_aiperf_figures_pair_its_itl_with_tpot_and_its_chunk_latency_with_itl():
    stat = lambda p50, avg=None: {"unit": "ms", "p50": p50, "avg": avg if avg is not None else p50}
    export = {"time_to_first_token": stat(300.0, 320.0), "inter_token_latency": stat(80.0),
              "inter_chunk_latency": stat(78.0, 79.0), "request_latency": stat(2000.0),
              "output_token_throughput": {"avg": 20.0}, "request_throughput": {"avg": 0.6},
              "usage_prompt_tokens": {"avg": 158.0}, "output_sequence_length": {"avg": 32.0},
              "overall_usage_prompt_cache_read_pct": {"avg": 70.0}, "request_count": {"avg": 16.0},
              "error_summary": [{"error_details": {}, "count": 2}], "benchmark_duration": {"avg": 26.0}}
    f = aiperf_figures(export)
    assert (f["ttft_p50_ms"], f["ttft_mean_ms"], f["itl_p50_ms"], f["chunk_gap_p50_ms"]) == (300, 320, 80, 78)
    assert (f["output_tokens_per_s"], f["cached_fraction"], f["completed"], f["failed"]) == (20.0, 0.7, 16, 2)


def test_loadtest_figures_read_tpot_as_the_per_request_itl():
    records = [make_record(index=i, send=0.0, times=(0.3, 0.4, 0.6), end=0.6, prompt=100, cached=50)
               for i in range(2)]
    report = build_report(records, duration_s=1.0, slo=SLO())
    f = loadtest_figures(report)
    assert f["ttft_p50_ms"] == pytest.approx(300.0) and f["itl_p50_ms"] == pytest.approx(150.0)  # (600-300)/2
    assert f["chunk_gap_p50_ms"] == pytest.approx(150.0)  # gaps 100 and 200, pooled
    assert (f["output_tokens_per_s"], f["cached_fraction"], f["completed"]) == (6.0, 0.5, 2)


EXPOSITION = """# TYPE pdserve_router_ttft_seconds histogram
pdserve_router_ttft_seconds_bucket{{le="+Inf"}} {n}
pdserve_router_ttft_seconds_count {n}
pdserve_router_ttft_seconds_sum {ttft}
# TYPE pdserve_router_itl_seconds histogram
pdserve_router_itl_seconds_count {gaps}
pdserve_router_itl_seconds_sum {itl}
# TYPE pdserve_router_requests counter
pdserve_router_requests_total{{code="OK"}} {n}
pdserve_router_requests_total{{code="RESOURCE_EXHAUSTED"}} 1
"""


def test_the_server_figures_are_the_histogram_means_between_two_scrapes():
    before = histogram_totals(EXPOSITION.format(n=10, ttft=4.0, gaps=300, itl=24.0))
    after = histogram_totals(EXPOSITION.format(n=14, ttft=5.6, gaps=400, itl=32.5))
    figures = server_figures(before, after)
    assert figures["requests"] == 4
    assert figures["ttft_mean_ms"] == pytest.approx(400.0) and figures["itl_mean_ms"] == pytest.approx(85.0)
    assert figures["e2e_mean_ms"] is None  # not exposed


def test_cpu_in_a_window_interpolates_between_samples_and_needs_them_to_cover_it():
    samples = [(10.0, 1.0), (11.0, 1.5), (12.0, 3.5)]
    assert cpu_in_window(samples, 10.5, 11.5) == pytest.approx(2.5 - 1.25)  # 1.25 at 10.5, 2.5 at 11.5
    assert cpu_in_window(samples, 9.0, 11.0) is None and cpu_in_window(samples[:1], 10.0, 10.0) is None


def test_agreement_is_every_headline_within_fifteen_percent():
    aiperf = {"ttft_p50_ms": 100.0, "itl_p50_ms": 80.0, "chunk_gap_p50_ms": 80.0, "output_tokens_per_s": 20.0,
              "completed": 16, "note": "x"}
    close = compare(aiperf, {**aiperf, "ttft_p50_ms": 114.0, "output_tokens_per_s": 17.2})
    assert close["agree"] and close["ratio_loadtest_over_aiperf"]["ttft_p50_ms"] == 1.14
    assert "note" not in close["ratio_loadtest_over_aiperf"]
    far = compare(aiperf, {**aiperf, "itl_p50_ms": 64.0})
    assert not far["agree"] and far["disagreeing"] == ["itl_p50_ms"]


def test_medians_over_reps():
    assert median_figures([{"a": 1.0, "b": None}, {"a": 3.0, "b": None}, {"a": 2.0, "b": None}]) == \
        {"a": 2.0, "b": None}
