"""Compare mode: the same workload (same seed, so the same requests) against two routers or two
configurations, or two report.json files; the ratio B/A of each key metric.

`compare_reports` and `format_comparison` are pure; `run_compare` runs A then B (one after
the other, never at once, so neither loads the machine while the other is measured).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loadtest.runner import LoadTestConfig

# (path into the report, which way is better)
METRICS = (
    ("ttft_ms.p50", "lower"), ("ttft_ms.p90", "lower"), ("ttft_ms.p99", "lower"),
    ("itl_ms.p50", "lower"), ("itl_ms.p90", "lower"), ("itl_ms.p99", "lower"),
    ("tpot_ms.p50", "lower"), ("tpot_ms.p90", "lower"), ("tpot_ms.p99", "lower"),
    ("e2e_ms.p50", "lower"), ("e2e_ms.p90", "lower"), ("e2e_ms.p99", "lower"),
    ("throughput_tokens_per_s", "higher"), ("requests_per_s", "higher"),
    ("goodput.requests_per_s", "higher"), ("goodput.fraction", "higher"),
    ("prefix_hit_rate", "higher"), ("counts.failed", "lower"),
)
COMPARE_FILE = "compare.json"


def lookup(report: Mapping[str, Any], path: str) -> float | None:
    value: Any = report
    for key in path.split("."):
        if not isinstance(value, Mapping) or key not in value:
            return None
        value = value[key]
    return value if isinstance(value, (int, float)) else None


def compare_reports(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    """{"a": label, "b": label, "metrics": {path: {"a", "b", "ratio_b_over_a", "better"}}}."""
    metrics = {}
    for path, better in METRICS:
        va, vb = lookup(a, path), lookup(b, path)
        ratio = vb / va if va and vb is not None else None
        metrics[path] = {"a": va, "b": vb, "ratio_b_over_a": None if ratio is None else round(ratio, 4),
                         "better": better}
    return {"a": _label(a, "A"), "b": _label(b, "B"), "workload": a.get("workload"),
            "same_workload": (a.get("workload"), a.get("seed")) == (b.get("workload"), b.get("seed")),
            "metrics": metrics, "errors": {"a": a.get("errors", {}), "b": b.get("errors", {})}}


def _label(report: Mapping[str, Any], default: str) -> str:
    return str(report.get("label") or report.get("router") or default)


def format_comparison(comparison: Mapping[str, Any]) -> str:
    lines = [f"A = {comparison['a']}", f"B = {comparison['b']}"]
    if not comparison["same_workload"]:
        lines.append("WARNING: the two runs used different workloads or seeds")
    lines.append(f"{'metric':<26}{'A':>12}{'B':>12}{'B/A':>9}  better")
    for path, m in comparison["metrics"].items():
        ratio = "-" if m["ratio_b_over_a"] is None else f"{m['ratio_b_over_a']:.3f}"
        lines.append(f"{path:<26}{_num(m['a']):>12}{_num(m['b']):>12}{ratio:>9}  {m['better']}")
    return "\n".join(lines)


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:,.3f}" if abs(x) < 10 else f"{x:,.1f}"


def load_report(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        report = json.load(f)
    if not isinstance(report, dict) or "ttft_ms" not in report:
        raise ValueError(f"{path} is not a loadtest report.json (no ttft_ms)")
    return report


def compare_files(path_a: str, path_b: str, out_dir: str | None = None) -> dict[str, Any]:
    comparison = compare_reports(load_report(path_a), load_report(path_b))
    if out_dir is not None:
        _write(out_dir, comparison)
    return comparison


def run_compare(config_a: LoadTestConfig, config_b: LoadTestConfig,
                out_dir: str | None = None) -> dict[str, Any]:
    """Run config_a then config_b (LoadTestConfigs; give both the same workload and seed) and
    compare them; with out_dir, each run's outputs go to out_dir/a and out_dir/b."""
    from loadtest.runner import run_loadtest

    report_a = run_loadtest(config_a, None if out_dir is None else os.path.join(out_dir, "a"))
    report_b = run_loadtest(config_b, None if out_dir is None else os.path.join(out_dir, "b"))
    comparison = compare_reports(report_a, report_b)
    if out_dir is not None:
        _write(out_dir, comparison)
    return {**comparison, "reports": {"a": report_a, "b": report_b}}


def _write(out_dir: str, comparison: Mapping[str, Any]) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, COMPARE_FILE), "w", encoding="utf-8") as f:
        json.dump(comparison, f, indent=2)
        f.write("\n")
