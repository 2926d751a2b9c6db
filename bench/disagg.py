"""The disaggregation experiment: 1 prefill + 1 decode worker against 2 colocated workers.

    python -m bench.disagg [--json] [--requests N] [--rate R] [--out DIR] [--slo-ttft-ms MS] ...

Both topologies get the same cores (one torch thread per worker, two workers) and the same
requests (a seeded `mixed` workload: long prompts with short answers alongside short prompts
with long answers, Poisson arrivals), one after the other on fresh clusters under fresh Ray:

  disaggregated  1 prefill + 1 decode worker. Long prompts are prefilled on the prefill worker
                 and their KV streamed to the decode worker; short prompts (under
                 --min-remote-prefill-tokens) are prefilled on the decode worker.
  colocated      0 prefill + 2 decode workers, least-load routing: each worker prefills its own
                 prompts, so a long prefill runs in the same engine steps as its decoding streams.

Measured by the load generator (client side, loadtest/): inter-token latency over every token
of every request, and goodput = requests meeting both the TTFT and the per-request p99
inter-token objective. Headlines:
    itl_p99_ratio  = ITL p99 disaggregated / colocated      (target <= 0.5)
    goodput_ratio  = goodput disaggregated / colocated      (target > 1)
Plots: each run's report and plots under DIR/<topology>/, and DIR/itl_cdf.png with both
inter-token latency CDFs on one axis.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from bench.common import progress

TOPOLOGIES = {"disaggregated": (1, 1), "colocated": (0, 2)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.disagg", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=40, help="requests per topology (default: %(default)s)")
    p.add_argument("--rate", type=float, default=0.2,
                   help="Poisson arrival rate, requests/s (default: %(default)s)")
    p.add_argument("--long-fraction", type=float, default=0.6,
                   help="share of long-prompt requests (default: %(default)s)")
    p.add_argument("--long-prompt", type=int, nargs=2, default=(400, 600), metavar=("MIN", "MAX"),
                   help="long prompts' length range, tokens (default: 400 600)")
    p.add_argument("--short-max-tokens", type=int, nargs=2, default=(128, 192), metavar=("MIN", "MAX"),
                   help="short requests' output length range, tokens (default: 128 192)")
    p.add_argument("--min-remote-prefill-tokens", type=int, default=128,
                   help="disaggregated: prompts shorter than this prefill on the decode worker "
                        "(default: %(default)s)")
    p.add_argument("--slo-ttft-ms", type=float, default=10000.0,
                   help="goodput objective: time to first token (default: %(default)s)")
    p.add_argument("--slo-itl-ms", type=float, default=1500.0,
                   help="goodput objective: a request's own p99 inter-token latency (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="workload and arrival seed (default: %(default)s)")
    p.add_argument("--out", default="bench/out/disagg",
                   help="where reports and plots go (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    return p.parse_args(argv)


def loadtest_config(args: argparse.Namespace, router: str, label: str):
    from loadtest.arrivals import Bounds, Poisson
    from loadtest.runner import LoadTestConfig, RequestOptions
    from loadtest.stats import SLO
    from loadtest.workloads import Mixed

    workload = Mixed(long_fraction=args.long_fraction, long_prompt_min=args.long_prompt[0],
                     long_prompt_max=args.long_prompt[1], short_prompt_tokens=30,
                     short_max_tokens_min=args.short_max_tokens[0],
                     short_max_tokens_max=args.short_max_tokens[1], token_ids=True)
    return LoadTestConfig(router=router, workload=workload, arrivals=Poisson(args.rate),
                          bounds=Bounds(args.requests, 1800.0), seed=args.seed,
                          slo=SLO(ttft_ms=args.slo_ttft_ms, itl_ms=args.slo_itl_ms, itl_stat="p99"),
                          options=RequestOptions(temperature=0.0, ignore_eos=True, timeout_s=600),
                          progress=not args.json, label=label)


def cluster_spec(args: argparse.Namespace, name: str) -> Any:
    """`pdserve up`'s cluster for topology `name`: least-load routing, prompts under
    --min-remote-prefill-tokens prefilled on the decode worker, 1,024 KV blocks a worker."""
    from deploy.config import ClusterSpec
    from pdserve.engine.config import CacheConfig, EngineConfig
    from router.config import PlacementConfig

    num_prefill, num_decode = TOPOLOGIES[name]
    threshold = args.min_remote_prefill_tokens
    placement = PlacementConfig(routing="least_load", min_remote_prefill_tokens=threshold)
    return ClusterSpec(num_prefill=num_prefill, num_decode=num_decode, port=0, placement=placement,
                       engine=EngineConfig(cache=CacheConfig(num_blocks=1024)), namespace=f"disagg-{name}")


def run_topology(args: argparse.Namespace, name: str) -> tuple[dict[str, Any], list]:
    from loadtest.report import write_outputs
    from loadtest.runner import run_loadtest_async
    from sim.measure.real import warmed_cluster

    spec = cluster_spec(args, name)
    with warmed_cluster(spec, say=lambda line: progress(f"{name}: {line}"), warm_tokens=300) as (_, router):
        progress(f"{name}: running {args.requests} requests at {args.rate}/s")
        import asyncio

        result = asyncio.run(run_loadtest_async(loadtest_config(args, router, name)))
        write_outputs(os.path.join(args.out, name), result.report, result.records)
        return result.report, result.records


def plot_itl_cdfs(path: str, itl_by_topology: dict[str, list[float]], slo_itl_ms: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, samples in itl_by_topology.items():
        xs = sorted(samples)
        ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=f"{name} ({len(xs)} gaps)")
    ax.axvline(slo_itl_ms, color="grey", linestyle="--", label=f"objective {slo_itl_ms:g} ms")
    ax.set_xscale("log")
    ax.set_xlabel("inter-token latency, ms (log)")
    ax.set_ylabel("fraction of gaps")
    ax.set_title("Mixed workload: 1 prefill + 1 decode vs 2 colocated workers")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summarise(reports: dict[str, dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    d, c = reports["disaggregated"], reports["colocated"]

    def ratio(a, b):
        return round(a / b, 4) if a is not None and b else None

    return {
        "itl_p99_ratio": ratio(d["itl_ms"]["p99"], c["itl_ms"]["p99"]),
        "goodput_ratio": ratio(d["goodput"]["requests_per_s"], c["goodput"]["requests_per_s"]),
        "targets": {"itl_p99_ratio": "<= 0.5", "goodput_ratio": "> 1"},
        "slo": {"ttft_ms": args.slo_ttft_ms, "itl_ms": args.slo_itl_ms, "itl_stat": "p99 per request"},
        "per_topology": {name: {k: r.get(k) for k in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms",
                                                      "throughput_tokens_per_s", "goodput", "counts",
                                                      "errors", "by_kind")}
                         for name, r in reports.items()},
        "workload": d.get("workload"), "arrival": d.get("arrival"), "cpu_count": os.cpu_count(),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    reports, itl = {}, {}
    for name in TOPOLOGIES:
        reports[name], records = run_topology(args, name)
        itl[name] = [gap for r in records if r.ok for gap in r.itl_ms]
    plot_itl_cdfs(os.path.join(args.out, "itl_cdf.png"), itl, args.slo_itl_ms)
    summary = summarise(reports, args)
    with open(os.path.join(args.out, "disagg.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        for name, r in reports.items():
            print(f"{name:<14} ITL p50/p99 {r['itl_ms']['p50']:.0f}/{r['itl_ms']['p99']:.0f} ms · "
                  f"TTFT p50/p99 {r['ttft_ms']['p50']:.0f}/{r['ttft_ms']['p99']:.0f} ms · goodput "
                  f"{r['goodput']['requests_per_s']:.3f} req/s ({100 * r['goodput']['fraction']:.0f}%)")
        print(f"ITL p99 disaggregated / colocated = {summary['itl_p99_ratio']} (target <= 0.5); "
              f"goodput ratio = {summary['goodput_ratio']} (target > 1); plots in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
