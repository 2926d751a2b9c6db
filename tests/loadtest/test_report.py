"""loadtest.report and loadtest.compare: the files a run writes, the printed tables, the ratios."""

from __future__ import annotations

import json

from loadtest.compare import compare_files, compare_reports, format_comparison
from loadtest.report import format_summary, write_outputs
from loadtest.stats import SLO, build_report
from tests.loadtest.records import make_record

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ISSUE_KEYS = {"ttft_ms", "itl_ms", "tpot_ms", "e2e_ms", "throughput_tokens_per_s", "goodput",
              "prefix_hit_rate", "errors"}


def sample_records():
    return [make_record(index=i, send=0.1 * i, times=[0.1 * i + 0.05 + 0.01 * k for k in range(5)],
                        prompt=100, cached=50, kind="long" if i % 2 else "short") for i in range(10)] + \
           [make_record(index=10, send=0.5, status="RESOURCE_EXHAUSTED", error="no KV blocks")]


def sample_report(**meta):
    meta = {"workload": {"name": "synthetic", "params": {}}, "seed": 0,
            "arrival": {"mode": "closed_loop", "concurrency": 2}, **meta}
    return build_report(sample_records(), duration_s=1.2, slo=SLO(), meta=meta)


def test_write_outputs_writes_the_report_json_requests_and_valid_pngs(tmp_path):
    report = sample_report()
    paths = write_outputs(str(tmp_path / "out"), report, sample_records())
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["latency_cdf.png", "report.json", "requests.jsonl",
                                                     "throughput.png"]
    assert len(paths) == 4
    written = json.loads((out / "report.json").read_text())
    assert ISSUE_KEYS <= set(written)
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        assert {"p50", "p90", "p99"} <= set(written[key])
        assert all(isinstance(written[key][p], float) for p in ("p50", "p90", "p99"))
    assert written["errors"] == {"RESOURCE_EXHAUSTED": 1}
    assert written == json.loads(json.dumps(report))
    lines = (out / "requests.jsonl").read_text().splitlines()
    assert len(lines) == 11 and json.loads(lines[10])["status"] == "RESOURCE_EXHAUSTED"
    for png in ("latency_cdf.png", "throughput.png"):
        data = (out / png).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 1000


def test_plots_survive_a_run_where_every_request_failed(tmp_path):
    records = [make_record(index=0, status="UNAVAILABLE")]
    report = build_report(records, duration_s=0.0, slo=SLO())
    write_outputs(str(tmp_path), report, records)
    assert (tmp_path / "latency_cdf.png").read_bytes()[:8] == PNG_MAGIC
    assert "UNAVAILABLE x1" in format_summary(report)


def test_summary_names_the_latencies_goodput_and_errors():
    text = format_summary(sample_report())
    for needle in ("TTFT ms", "ITL ms", "TPOT ms", "E2E ms", "goodput:", "prefix hit rate: 50.0%",
                   "RESOURCE_EXHAUSTED x1", "long:", "short:"):
        assert needle in text


def test_compare_gives_the_ratio_b_over_a():
    a = {"label": "A", "ttft_ms": {"p50": 100.0, "p90": 200.0, "p99": 400.0},
         "throughput_tokens_per_s": 50.0, "prefix_hit_rate": 0.0, "counts": {"failed": 0}}
    b = {"label": "B", "ttft_ms": {"p50": 50.0, "p90": 200.0, "p99": 100.0},
         "throughput_tokens_per_s": 75.0, "prefix_hit_rate": 0.5, "counts": {"failed": 2}}
    metrics = compare_reports(a, b)["metrics"]
    assert metrics["ttft_ms.p50"] == {"a": 100.0, "b": 50.0, "ratio_b_over_a": 0.5, "better": "lower"}
    assert metrics["ttft_ms.p99"]["ratio_b_over_a"] == 0.25
    assert metrics["throughput_tokens_per_s"]["ratio_b_over_a"] == 1.5
    assert metrics["prefix_hit_rate"]["ratio_b_over_a"] is None  # A is 0: no ratio
    assert metrics["itl_ms.p50"] == {"a": None, "b": None, "ratio_b_over_a": None, "better": "lower"}
    text = format_comparison(compare_reports(a, b))
    assert "A = A" in text and "0.500" in text


def test_compare_files_reads_two_reports_and_writes_compare_json(tmp_path):
    for name, label in (("a.json", "one"), ("b.json", "two")):
        (tmp_path / name).write_text(json.dumps(sample_report(label=label)))
    comparison = compare_files(str(tmp_path / "a.json"), str(tmp_path / "b.json"), str(tmp_path / "cmp"))
    assert comparison["a"] == "one" and comparison["b"] == "two" and comparison["same_workload"]
    assert comparison["metrics"]["e2e_ms.p50"]["ratio_b_over_a"] == 1.0
    assert json.loads((tmp_path / "cmp" / "compare.json").read_text()) == comparison
