"""loadtest.server_metrics: the router's counters parsed from Prometheus text, and their deltas."""

from __future__ import annotations

import socket

from prometheus_client import CollectorRegistry, Counter, generate_latest

from loadtest.server_metrics import MetricsProbe, counter_deltas, parse_counters


def exposition(ok: int, exhausted: int, prompt: int) -> str:
    registry = CollectorRegistry()
    requests = Counter("pdserve_router_requests", "calls", ["code"], registry=registry)
    requests.labels("OK").inc(ok)
    if exhausted:
        requests.labels("RESOURCE_EXHAUSTED").inc(exhausted)
    Counter("pdserve_router_prompt_tokens", "prompt", registry=registry).inc(prompt)
    Counter("pdserve_router_other", "not ours", registry=registry).inc(9)
    return generate_latest(registry).decode()


def test_parse_counters_reads_the_total_samples_by_code():
    counters = parse_counters(exposition(ok=5, exhausted=2, prompt=300))
    assert counters == {"pdserve_router_requests_total": {"OK": 5.0, "RESOURCE_EXHAUSTED": 2.0},
                        "pdserve_router_prompt_tokens_total": 300.0}


def test_parse_counters_accepts_an_untyped_sample_without_the_suffix():
    text = 'pdserve_router_requests{code="OK"} 3\npdserve_router_cached_tokens_total 12\n'
    assert parse_counters(text) == {"pdserve_router_requests_total": {"OK": 3.0},
                                    "pdserve_router_cached_tokens_total": 12.0}


def test_counter_deltas_subtract_and_mark_missing_counters():
    before = parse_counters(exposition(ok=5, exhausted=0, prompt=300))
    after = parse_counters(exposition(ok=9, exhausted=2, prompt=700))
    assert counter_deltas(before, after) == {
        "pdserve_router_requests_total": {"OK": 4.0, "RESOURCE_EXHAUSTED": 2.0},
        "pdserve_router_prompt_tokens_total": 400.0,
        "pdserve_router_cached_tokens_total": None,
        "pdserve_router_generated_tokens_total": None}


def test_an_unreachable_url_becomes_an_error_in_the_report_not_an_exception():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/metrics"
    probe = MetricsProbe(url, timeout_s=1.0)
    probe.before()
    section = probe.after()
    assert section["url"] == url and "before the run failed" in section["error"]
