"""Writing a run's results: DIR/report.json, DIR/requests.jsonl (one record per request),
DIR/latency_cdf.png (TTFT, ITL, E2E CDFs) and DIR/throughput.png (output tokens/s and
completed requests over time); and the short table printed at the end of a run.

matplotlib is imported only when plotting, with the Agg backend (no display needed).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from loadtest.stats import RequestRecord

REPORT_FILE = "report.json"
REQUESTS_FILE = "requests.jsonl"
LATENCY_PLOT = "latency_cdf.png"
THROUGHPUT_PLOT = "throughput.png"
CDF_POINTS = 2000


def write_outputs(out_dir: str, report: Mapping[str, Any], records: Sequence[RequestRecord]) -> list[str]:
    """Write every output file into out_dir (created if needed); returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, name) for name in (REPORT_FILE, REQUESTS_FILE, LATENCY_PLOT,
                                                      THROUGHPUT_PLOT)]
    write_json(paths[0], report)
    with open(paths[1], "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record.as_json()) + "\n")
    plot_latency_cdfs(paths[2], records, title=_title(report))
    plot_throughput(paths[3], report, title=_title(report))
    return paths


def write_json(path: str, obj: Mapping[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def _title(report: Mapping[str, Any]) -> str:
    workload = report.get("workload", {}).get("name", "?")
    arrival = report.get("arrival", {})
    how = (f"concurrency {arrival.get('concurrency')}" if arrival.get("mode") == "closed_loop"
           else f"rate {arrival.get('rate') or 'inf'}/s")
    label = report.get("label")
    return f"{label}: {workload}, {how}" if label else f"{workload}, {how}"


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_latency_cdfs(path: str, records: Sequence[RequestRecord], title: str = "") -> None:
    plt = _pyplot()
    ok = [r for r in records if r.ok]
    series = {"TTFT": [r.ttft_ms for r in ok if r.ttft_ms is not None],
              "ITL": [x for r in ok for x in r.itl_ms],
              "E2E": [r.e2e_ms for r in ok]}
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, (name, values) in zip(axes, series.items()):
        xs = sorted(values)
        if xs:
            # at most CDF_POINTS points: a long run has ITL samples by the hundred thousand
            ranks = range(0, len(xs), max(1, len(xs) // CDF_POINTS))
            ax.step([xs[i] for i in ranks] + [xs[-1]], [(i + 1) / len(xs) for i in ranks] + [1.0],
                    where="post")
        else:
            ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
        ax.ticklabel_format(axis="x", useOffset=False)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of samples")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.set_title(f"{name} CDF ({len(xs)} samples)")
    fig.suptitle(title)
    # NOTE: fixed margins, not tight_layout, which renders the figure twice (slow on a busy CPU)
    fig.subplots_adjust(left=0.05, right=0.98, bottom=0.14, top=0.84, wspace=0.28)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_throughput(path: str, report: Mapping[str, Any], title: str = "") -> None:
    plt = _pyplot()
    tl = report["timeline"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    top.plot(tl["t_s"], tl["output_tokens_per_s"], drawstyle="steps-pre")
    top.set_ylabel("output tokens/s")
    top.grid(alpha=0.3)
    bottom.plot(tl["t_s"], tl["completed"], drawstyle="steps-pre", color="tab:green")
    bottom.set_ylabel("completed requests")
    bottom.set_xlabel("time since start (s)")
    bottom.grid(alpha=0.3)
    fig.suptitle(title)
    fig.subplots_adjust(left=0.09, right=0.97, bottom=0.09, top=0.92, hspace=0.12)
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --- the printed summary ------------------------------------------------------------------------

def format_summary(report: Mapping[str, Any]) -> str:
    """A short human-readable table of a report."""
    c, g = report["counts"], report["goodput"]
    lines = [
        f"{_title(report)}",
        f"requests: {c['sent']} sent, {c['completed']} ok, {c['failed']} failed, {c['skipped']} skipped "
        f"in {report['duration_s']} s (stopped by {report.get('stopped_by', '?')})",
        f"{'':<10}{'p50':>10}{'p90':>10}{'p99':>10}{'mean':>10}",
    ]
    for key, name in (("ttft_ms", "TTFT ms"), ("itl_ms", "ITL ms"), ("tpot_ms", "TPOT ms"),
                      ("e2e_ms", "E2E ms")):
        s = report[key]
        lines.append(f"{name:<10}" + "".join(f"{_num(s[k]):>10}" for k in ("p50", "p90", "p99", "mean")))
    slo = report["slo"]
    lines += [
        f"throughput: {_num(report['throughput_tokens_per_s'])} output tokens/s, "
        f"{_num(report['requests_per_s'])} requests/s",
        f"goodput: {_num(g['requests_per_s'])} requests/s ({_pct(g['fraction'])} of sent) meeting "
        f"TTFT <= {slo['ttft_ms']:g} ms and {slo['itl_criterion']} ITL <= {slo['itl_ms']:g} ms",
        f"prefix hit rate: {_pct(report['prefix_hit_rate'])} "
        f"({report['cached_tokens_total']:,} of {report['prompt_tokens_total']:,} prompt tokens cached)",
    ]
    if report["errors"]:
        lines.append("errors: " + ", ".join(f"{code} x{n}" for code, n in report["errors"].items()))
    for kind, k in report.get("by_kind", {}).items():
        lines.append(f"  {kind}: {k['completed']}/{k['sent']} ok, TTFT p50 {_num(k['ttft_ms']['p50'])} ms, "
                     f"ITL p50 {_num(k['itl_ms']['p50'])} ms, E2E p50 {_num(k['e2e_ms']['p50'])} ms")
    server = report.get("server_metrics")
    if server and server.get("error"):
        lines.append(f"server metrics: {server['error']}")
    elif server:
        counts = {name.removeprefix("pdserve_router_").removesuffix("_total"): value
                  for name, value in server.items() if name.startswith("pdserve_router_")}
        lines.append("server metrics (deltas): " + ", ".join(f"{k} {_counter(v)}" for k, v in counts.items()))
    return "\n".join(lines)


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:,.1f}"


def _counter(value: float | dict[str, float] | None) -> str:
    if value is None:
        return "not exposed"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{code} {n:g}" for code, n in value.items()) + "}"
    return f"{value:,.0f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"
