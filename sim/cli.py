"""`pdserve sim`: run the simulator, calibrate its costs here, size a deployment.

    pdserve sim run       --workload NAME|--trace FILE --rate R --prefill P --decode D --costs FILE [--json]
    pdserve sim calibrate [--out FILE] [--quick] [--threads N] [--in-cluster]
    pdserve sim size      --workload NAME|--trace FILE --rate R --slo ttft_p90_ms=..,itl_p99_ms=..
                          --gpus N --costs FILE [--json] [--plot FILE]

Registered by deploy/cli.py; imports only argparse and pure modules until a command runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from loadtest.workloads import WORKLOADS, make_workload, parse_params
from sim.cluster import ROUTING, ClusterShape
from sim.size import DEFAULT_SLO

# The simulator's own cost files, found beside this module (the wheel ships them as package data), not
# relative to where the command was started.
DATA = Path(__file__).resolve().parent / "data"
DEFAULT_CPU_COSTS, GPU_COSTS = str(DATA / "this_machine.json"), str(DATA / "h100_llama8b.json")


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "sim",
        help="the cluster simulator: run, calibrate its costs, size a deployment",
        description="A discrete-event simulator of a pdserve cluster (docs/simulator.md).",
    )
    sub = p.add_subparsers(dest="sim_command", required=True, metavar="SUBCOMMAND")
    _add_run(sub)
    _add_calibrate(sub)
    _add_size(sub)


def _add_arrivals(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--workload",
        choices=tuple(WORKLOADS),
        default="synthetic",
        help="a load tester workload (loadtest/workloads.py; default: %(default)s)",
    )
    src.add_argument(
        "--trace",
        metavar="FILE",
        help="a trace: CSV or JSON lines of arrival_s, prompt_tokens, "
        "output_tokens, optional prefix_id and prefix_tokens (sim/workload.py)",
    )
    p.add_argument(
        "-p",
        "--param",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a workload parameter, as for `pdserve loadtest` (repeatable)",
    )
    p.add_argument(
        "--requests", type=int, default=500, metavar="N", help="requests to simulate (default: %(default)s)"
    )
    p.add_argument("--rate", type=float, required=True, metavar="R", help="Poisson arrivals, requests/s")
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the workload, arrivals and router (default: 0)"
    )
    p.add_argument(
        "--costs",
        default=DEFAULT_CPU_COSTS,
        metavar="FILE",
        help="cost model JSON (default: the simulator's sim/data/this_machine.json, from `pdserve sim "
        f"calibrate`; GPU-shaped: {GPU_COSTS})",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def _add_run(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="simulate one cluster shape; print the load tester's report",
        description="Simulate one cluster; the report has the fields of `pdserve loadtest`'s.",
    )
    _add_arrivals(p)
    p.add_argument("--prefill", type=int, default=1, help="prefill workers; 0 = colocated (default: 1)")
    p.add_argument("--decode", type=int, default=1, help="decode workers (default: 1)")
    p.add_argument("--routing", choices=ROUTING, default="prefix", help="router policy (default: prefix)")
    p.set_defaults(handler=_run)


def _add_calibrate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "calibrate",
        help="fit the cost model from the engine and KV-transfer runs on this machine",
        description="Time the real engine's steps (prefill by new and cached tokens, decode by "
        "batch and context) and a gRPC KV push; fit sim/costs.py; write JSON.",
    )
    p.add_argument(
        "--out", default=DEFAULT_CPU_COSTS, metavar="FILE",
        help="where to write (default: the simulator's sim/data/this_machine.json, read by `run` and `size`)"
    )
    p.add_argument("--quick", action="store_true",
                   help="one repetition per grid point instead of two, no decode batches of 4 or 8 "
                        "at the long context, and no measurement of two workers sharing the machine "
                        "(shared_machine_slowdown stays 0; what the test suite calibrates with)")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="torch threads of the engine timed: those of the workers the costs stand for "
                        "(default: what each of two CPU workers on this machine gets, as in `pdserve up`'s "
                        "1 prefill + 1 decode)")
    p.add_argument("--in-cluster", action="store_true",
                   help="fit the costs to the steps of a running cluster instead of an engine alone: start "
                        "`pdserve up`'s local cluster (1 prefill + 1 decode, then 2 colocated), send the "
                        "calibration loads through its router and fit every step its workers trace "
                        "(Worker.Steps). Steps there are longer than an engine's alone (the workers' gRPC "
                        "threads, the router and the load tester share the cores); about 3 minutes here. "
                        "--quick does not apply")
    p.add_argument("--no-progress", action="store_true", help="do not show progress bars")
    p.set_defaults(handler=_calibrate)


def _add_size(sub: argparse._SubParsersAction) -> None:
    slo = ",".join(f"{k}={v:g}" for k, v in DEFAULT_SLO.items())
    p = sub.add_parser(
        "size",
        help="search prefill:decode splits and router policies for the best goodput",
        description="Simulate colocated and every P:D split of --gpus under every router "
        "policy at --rate; print goodput for each and the best.",
    )
    _add_arrivals(p)
    p.add_argument(
        "--slo",
        default=slo,
        metavar="ttft_p90_ms=MS,itl_p99_ms=MS",
        help="the service level objective (default: %(default)s)",
    )
    p.add_argument("--gpus", type=int, default=4, metavar="N", help="workers to split (default: %(default)s)")
    p.add_argument(
        "--policies", default=",".join(ROUTING), help="router policies to try (default: %(default)s)"
    )
    p.add_argument(
        "--no-bisect", action="store_true", help="skip the search for each candidate's highest rate"
    )
    p.add_argument("--plot", metavar="FILE.png", help="plot goodput against rate for the top 3 candidates")
    p.add_argument("--no-progress", action="store_true", help="do not print progress to stderr")
    p.set_defaults(handler=_size)


def requests_for(args: argparse.Namespace):
    from sim.workload import from_trace, from_workload

    if args.trace:
        base = from_trace(args.trace, args.seed)
        span = max(base[-1].arrival_s, 1e-9)

        def scaled(rate: float):  # the trace's own pattern, compressed or stretched to the rate
            factor = (len(base) / span) / rate
            return [r.__class__(**{**vars(r), "arrival_s": r.arrival_s * factor}) for r in base]

        return scaled
    workload = make_workload(args.workload, parse_params(args.param))
    return lambda rate: from_workload(workload, args.requests, rate, args.seed)


def _run(args: argparse.Namespace) -> int:
    from loadtest.stats import SLO, build_report
    from sim.cluster import simulate
    from sim.costs import load_costs

    costs = load_costs(args.costs)
    requests = requests_for(args)(args.rate)
    t0 = time.perf_counter()
    result = simulate(
        requests, ClusterShape(args.prefill, args.decode, routing=args.routing), costs, args.seed
    )
    wall = time.perf_counter() - t0
    report = build_report(result.records, duration_s=result.duration_s, slo=SLO())
    report["simulator"] = {
        "wall_s": round(wall, 3),
        "simulated_requests_per_s": round(len(requests) / wall, 1),
        "events": result.events,
        "steps": result.steps,
        "preemptions": result.preemptions,
    }
    if args.json:
        print(json.dumps(report))
        return 0
    keys = ("ttft_ms", "itl_ms")
    print(
        f"{len(requests)} requests, {result.duration_s:.1f} s simulated in {wall:.2f} s "
        f"({len(requests) / wall:,.0f} requests/s)"
    )
    for k in keys:
        print(f"  {k}: " + "  ".join(f"{s}={report[k][s]}" for s in ("p50", "p90", "p99")))
    print(
        f"  throughput {report['throughput_tokens_per_s']} tokens/s, "
        f"prefix hit rate {report['prefix_hit_rate']}, "
        f"preemptions {result.preemptions}"
    )
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from pdserve.engine.config import cpu_threads_per_worker
    from sim.costs import save_costs
    from sim.measure.calibrate import calibrate

    threads = cpu_threads_per_worker(2) if args.threads is None else args.threads
    if threads < 1:
        print(f"pdserve sim calibrate: --threads must be >= 1, got {threads}", file=sys.stderr)
        return 2
    if args.in_cluster:
        model = _calibrate_in_cluster(args, threads)
        if model is None:
            return 2
    else:
        model = calibrate(threads, quick=args.quick, progress=not args.no_progress)
    save_costs(model, args.out)
    print(json.dumps(model.to_json(), indent=2))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def _calibrate_in_cluster(args: argparse.Namespace, threads: int):
    """The cost model fitted in a running cluster; None (after saying why) for flags it cannot take."""
    from pdserve.engine.config import cpu_threads_per_worker
    from sim.measure.calibrate_cluster import calibrate_in_cluster

    if args.quick or threads != cpu_threads_per_worker(2):
        print(f"pdserve sim calibrate: --in-cluster times the workers `pdserve up` starts here, "
              f"{cpu_threads_per_worker(2)} torch threads each; drop --quick and --threads", file=sys.stderr)
        return None
    def say(line: str) -> None:
        if not args.no_progress:
            print(f"calibrate: {line}", file=sys.stderr, flush=True)

    return calibrate_in_cluster(threads, say=say)


def _size(args: argparse.Namespace) -> int:
    from sim.costs import load_costs
    from sim.size import SizingSLO, size

    costs, slo = load_costs(args.costs), SizingSLO.parse(args.slo)
    policies = [p for p in args.policies.split(",") if p]
    make = requests_for(args)
    say = None if args.no_progress else (lambda s: print(f"  simulating {s}", file=sys.stderr))
    out = size(make, args.rate, args.gpus, costs, slo, args.seed, policies, not args.no_bisect, say)
    if args.plot:
        from sim.plot import plot_goodput

        out["plot"] = plot_goodput(out, make, costs, slo, Path(args.plot), args.seed)
    if args.json:
        print(json.dumps(out))
        return 0
    print(
        f"{args.gpus} workers, {args.rate:g} requests/s, SLO TTFT p90 <= {slo.ttft_p90_ms:g} ms, "
        f"ITL p99 <= {slo.itl_p99_ms:g} ms"
    )
    print(
        f"  {'split':<14} {'policy':<12} {'goodput/s':>9} {'max rate/s':>10} "
        f"{'TTFT p90':>9} {'ITL p99':>8}  SLO"
    )
    for c in out["candidates"]:
        print(
            f"  {c['split']:<14} {c['policy']:<12} {c['goodput_rps']:>9} {c.get('max_rate_rps', '-'):>10} "
            f"{c['ttft_p90_ms']:>9} {c['itl_p99_ms']:>8}  {'met' if c['slo_met'] else 'missed'}"
        )
    b = out["best"]
    print(f"best: {b['split']} with {b['policy']} routing ({b['goodput_rps']} requests/s within the SLO)")
    return 0
