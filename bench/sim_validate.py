"""The simulator against the real cluster: same workloads, seeds and arrival times, both reports.

    python -m bench.sim_validate [--json] [--requests N] [--reps N] [--costs sim/data/this_machine.json]
    python -m bench.sim_validate --rescore SAVED.json --costs OTHER.json [--json]

For each topology (1 prefill + 1 decode; 2 colocated) it starts the real cluster with
`pdserve up`'s LocalCluster (deploy/launcher.py), runs `pdserve loadtest`'s runner on each workload
(synthetic, shared-prefix, multi-turn) at a light and a near-saturation rate, and simulates the
same requests (sim/workload.py builds them from the same workload, seed and arrival schedule) on
a simulated cluster of the same shape with the calibrated costs. Per run and metric it reports
measured, simulated and the relative error |sim - real| / real; `within` says whether it is
inside --tolerance (0.2 by default, the issue's target). The load average is recorded: the
machine is shared, and the real numbers move with it.

--rescore takes a saved --json result and simulates its runs again with --costs, against the same
real measurements (no cluster starts): how another cost model would have scored on those runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from bench.common import check_least, progress
from pdserve.engine.scheduler import StepShape
from sim.measure.real import TOPOLOGIES

WORKLOADS = {
    "synthetic": {"input_tokens": 128, "output_tokens": 24},
    "shared-prefix": {"system_prompt_tokens": 256, "question_tokens": 24, "output_tokens": 24},
    "multi-turn": {"turns": 3, "turn_tokens": 32, "output_tokens": 24},
}
METRICS = {
    "ttft_p50_ms": ("ttft_ms", "p50"),
    "ttft_p90_ms": ("ttft_ms", "p90"),
    "itl_p50_ms": ("itl_ms", "p50"),
    "itl_p99_ms": ("itl_ms", "p99"),
    "throughput_tokens_per_s": ("throughput_tokens_per_s", None),
    "prefix_hit_rate": ("prefix_hit_rate", None),
}


def metric(report: dict[str, Any], name: str) -> float | None:
    key, stat = METRICS[name]
    value = report.get(key)
    return value.get(stat) if stat else value


def compare(real: dict[str, Any], simulated: dict[str, Any], tolerance: float) -> dict[str, Any]:
    return {name: cell(metric(real, name), metric(simulated, name), tolerance) for name in METRICS}


def cell(real: float | None, sim: float | None, tolerance: float) -> dict[str, Any]:
    err = None if real in (None, 0) or sim is None else abs(sim - real) / abs(real)
    return {
        "real": real,
        "sim": sim,
        "rel_error": None if err is None else round(err, 3),
        "within": err is not None and err <= tolerance,
    }


def simulate_like(
    workload_name: str,
    params: dict,
    requests: int,
    rate: float,
    seed: int,
    shape: tuple[int, int],
    costs_path: str,
) -> dict[str, Any]:
    from loadtest.stats import SLO, build_report
    from loadtest.workloads import make_workload
    from sim.cluster import ClusterShape, simulate
    from sim.costs import load_costs
    from sim.workload import from_workload

    reqs = from_workload(make_workload(workload_name, params), requests, rate, seed)
    result = simulate(reqs, ClusterShape(*shape, routing="prefix"), load_costs(costs_path), seed)
    report = build_report(result.records, duration_s=result.duration_s, slo=SLO())
    return report, steps_entry(result.steps, result.step_seconds)


def steps_entry(steps: int, seconds: float) -> dict[str, Any]:
    """Engine steps that had work, summed over the workers: how many, their time, the mean step."""
    mean_ms = round(1000 * seconds / steps, 1) if steps else None
    return {"steps": steps, "busy_s": round(seconds, 2), "step_ms_mean": mean_ms}


def load_result(path: str) -> dict[str, Any]:
    """A saved `--json` result (its last line: progress may precede it)."""
    with open(path) as f:
        return json.loads(f.read().strip().splitlines()[-1])


def every_rep(saved: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of every rep of a saved result, the first rep's first."""
    return [row for rep in [saved["runs"], *saved.get("later_reps", [])] for row in rep]


def real_trace(row: dict[str, Any]) -> list[list]:
    """A saved run's real step trace (real_steps_entry's rows); empty for runs that kept none."""
    return ((row.get("steps") or {}).get("real") or {}).get("trace") or []


def trace_span(step: list) -> tuple[str, float, float] | None:
    """(worker, start, seconds) of a trace row; None for rows written before 2026-12-06 22:30, which
    end at the gap."""
    return (step[5], step[6], step[3]) if len(step) >= 7 else None


def trace_shape(row: list) -> StepShape:
    """A real step of a result's trace ([prefill chunks as (new, before), decode sequences, their
    context, seconds, gap]) as the engine's StepShape."""
    chunks, seqs, context = row[:3]
    return StepShape(tuple(tuple(c) for c in chunks), seqs, context)


def real_steps_entry(trace: list[list], costs_path: str) -> dict[str, Any]:
    """The real workers' traced steps of a run (each [prefill chunks as (new, before), decode
    sequences, their context, seconds, the worker's time since the step before or None, the worker,
    its start on the machine's monotonic clock]; results before 2026-12-06 22:30 end at the gap):
    steps_entry's figures, the trace itself, what the cost file's formula (without its spread) gives
    for those very steps, and the summed gaps between steps. busy_over_formula near 1 says the costs
    price the real steps right, so a miss elsewhere comes from how the steps were batched."""
    from sim.costs import load_costs

    costs = load_costs(costs_path)
    busy = formula = 0.0
    gaps = []
    for row in trace:  # NOTE: no gap (row[4]) in results written before 2026-12-06 16:05
        shape, seconds, gap = trace_shape(row), row[3], row[4:5]
        busy += seconds
        formula += costs.step_s(list(shape.prefill), shape.decode_seqs, shape.decode_context)
        gaps += [g for g in gap if g is not None]
    return {**steps_entry(len(trace), busy), "formula_s": round(formula, 2),
            "busy_over_formula": round(busy / formula, 3) if formula else None,
            "gap_s": round(sum(gaps), 4) if gaps else None, "trace": trace}


def run_topology(
    name: str, runs: list[tuple[str, float, int]], args: argparse.Namespace
) -> list[dict[str, Any]]:
    from sim.measure.real import Load, real_cluster, run_load, traced_steps

    rows = []
    with real_cluster(name, say=progress) as (cluster, router):
        _, after = traced_steps(cluster, {})
        for workload, rate, seed in runs:
            progress(f"{name}: {workload} at {rate}/s, {args.requests} requests")
            load = os.getloadavg()
            run = Load(workload, WORKLOADS[workload], rate, args.requests, seed)
            real = run_load(router, run, name).report
            steps, after = traced_steps(cluster, after)
            trace = [[[list(c) for c in t.shape.prefill], t.shape.decode_seqs, t.shape.decode_context,
                      round(t.seconds, 5), None if t.gap_s is None else round(t.gap_s, 6), t.worker,
                      round(t.started_at, 6)] for t in steps]
            sim, sim_steps = simulate_like(
                workload,
                WORKLOADS[workload],
                args.requests,
                rate,
                seed,
                TOPOLOGIES[name],
                args.costs,
            )
            rows.append(
                {
                    "topology": name,
                    "workload": workload,
                    "rate": rate,
                    "seed": seed,
                    "load_average_1m": round(load[0], 2),
                    "metrics": compare(real, sim, args.tolerance),
                    # requests each worker served (the load tester's report): where placement differs
                    "workers": {"real": real.get("workers"), "sim": sim.get("workers")},
                    # where a miss comes from: slower steps, or more of them (not counted in `within`)
                    "steps": {"real": real_steps_entry(trace, args.costs), "sim": sim_steps},
                }
            )
    return rows


def check_costs_threads(costs_path: str, threads: int) -> None:
    """The costs must be timed at the torch threads the real workers get: a step at 1 thread takes
    about twice one at 2, and a file calibrated at another count was the whole ITL miss once."""
    from sim.costs import load_costs

    recorded = load_costs(costs_path).source.get("torch_threads")
    if recorded != threads:
        raise SystemExit(f"{costs_path} was calibrated at {recorded or 'unrecorded'} torch threads; the real "
                         f"cluster's workers get {threads} each here. Recalibrate: `pdserve sim calibrate "
                         f"--threads {threads} --out {costs_path}`")


def validate(args: argparse.Namespace) -> dict[str, Any]:
    from pdserve.engine.config import cpu_threads_per_worker

    # Both topologies have two workers, so each gets half the cores (deploy/launcher.py).
    check_costs_threads(args.costs, cpu_threads_per_worker(2))
    # NOTE: a seed per run: the real cluster keeps its prefix cache between runs, so a run that repeated
    # an earlier run's prompts would hit them all; the simulator starts every run cold.
    rates = (args.light_rate, args.heavy_rate)
    runs = [(w, rate, 10 + 2 * i + j) for i, w in enumerate(args.workloads) for j, rate in enumerate(rates)]
    reps = []
    for rep in range(args.reps):  # NOTE: each rep starts its clusters afresh: no prefix cache carries over
        if args.reps > 1:
            progress(f"rep {rep + 1} of {args.reps}")
        reps.append([row for topo in args.topologies for row in run_topology(topo, runs, args)])
    return assemble(reps, args.tolerance, args.requests, args.costs)


def assemble(reps: list[list[dict[str, Any]]], tolerance: float, requests: int, costs: str) -> dict[str, Any]:
    """The result of a validation: the first rep's rows and count as `runs` and `within` (what the
    table and --rescore read), and with 2 reps or more every later rep's rows (`later_reps`) and
    what repeating says (`repeats`)."""
    cells = [m for r in reps[0] for m in r["metrics"].values()]
    result = {
        "tolerance": tolerance,
        "requests_per_run": requests,
        "costs": costs,
        "within": sum(c["within"] for c in cells),
        "cells": len(cells),
        "runs": reps[0],
    }
    if len(reps) > 1:
        result["later_reps"] = reps[1:]
        result["repeats"] = summarize_repeats(reps, tolerance)
    return result


def rescore(saved: dict[str, Any], costs_path: str, tolerance: float) -> dict[str, Any]:
    """A saved result's runs simulated again with another cost file, against their real measurements."""
    runs = []
    for row in saved["runs"]:
        sim, sim_steps = simulate_like(row["workload"], WORKLOADS[row["workload"]], saved["requests_per_run"],
                                       row["rate"], row["seed"], TOPOLOGIES[row["topology"]], costs_path)
        metrics = {name: cell(c["real"], metric(sim, name), tolerance) for name, c in row["metrics"].items()}
        real = (row.get("steps") or {}).get("real")
        if real and "trace" in real:  # the formula of the new costs on the same real steps
            real = real_steps_entry(real["trace"], costs_path)
        steps = {"real": real, "sim": sim_steps} if real else None
        runs.append({**row, "metrics": metrics, "steps": steps})
    cells = [c for r in runs for c in r["metrics"].values()]
    return {"tolerance": tolerance, "requests_per_run": saved["requests_per_run"], "costs": costs_path,
            "rescored_from": saved["costs"], "within": sum(c["within"] for c in cells), "cells": len(cells),
            "runs": runs}


def summarize_repeats(reps: list[list[dict[str, Any]]], tolerance: float) -> dict[str, Any]:
    """What repeating the real runs says (reps: each rep's rows, in the same order).

    real_self_within: the share of (cell, rep) where that rep's real value is within tolerance of the
    mean of the other reps' (how often a simulator that predicted the real mean exactly would pass
    one run: the ceiling the machine's own noise puts on the per-run target); sim_vs_real_mean: the
    cells whose simulated value (the same in every rep) is within tolerance of the reps' real mean.
    """
    within_per_rep = [sum(c["within"] for row in rows for c in row["metrics"].values()) for rows in reps]
    self_hits, self_cells, sim_hits, cells = 0, 0, 0, 0
    for rows in zip(*reps):
        for name in rows[0]["metrics"]:
            real = [row["metrics"][name]["real"] for row in rows]
            sim = rows[0]["metrics"][name]["sim"]
            if any(v is None for v in real) or sim is None:
                continue
            cells += 1
            mean = sum(real) / len(real)
            sim_hits += mean != 0 and abs(sim - mean) / abs(mean) <= tolerance
            for value in real:
                others = (sum(real) - value) / (len(real) - 1)
                self_cells += 1
                self_hits += others != 0 and abs(value - others) / abs(others) <= tolerance
    return {"reps": len(reps), "within_per_rep": within_per_rep,
            "real_self_within": round(self_hits / self_cells, 3) if self_cells else None,
            "sim_vs_real_mean_within": sim_hits, "cells": cells}


def table(result: dict[str, Any]) -> str:
    lines = [
        f"{'topology':<12} {'workload':<14} {'rate':>5} {'load':>5}  "
        + "  ".join(f"{m:>24}" for m in METRICS) + f"  {'step ms mean, real/formula':>26}"
    ]
    for r in result["runs"]:
        cells = [
            f"{_fmt(c['real'])}/{_fmt(c['sim'])} {'ok' if c['within'] else 'MISS'}"
            for c in r["metrics"].values()
        ]
        steps = _step_means(r.get("steps"))
        lines.append(
            f"{r['topology']:<12} {r['workload']:<14} {r['rate']:>5} {r['load_average_1m']:>5}  "
            + "  ".join(f"{c:>24}" for c in cells) + f"  {steps:>26}"
        )
    lines.append(
        f"{result['within']} of {result['cells']} metrics within {result['tolerance']:.0%} (real/sim)"
    )
    rep = result.get("repeats")
    if rep:
        lines.append(
            f"{rep['reps']} reps: within per rep {rep['within_per_rep']}; a real run within "
            f"{result['tolerance']:.0%} of the other runs' mean in {rep['real_self_within']:.0%} of cells; "
            f"the simulator within it of the real mean in {rep['sim_vs_real_mean_within']} of {rep['cells']}"
        )
    return "\n".join(lines)


def _step_means(steps: dict[str, Any] | None) -> str:
    """real/simulated mean step, and (for runs that traced their steps) the real steps' busy time over
    the formula's for them; "-" for results written before runs recorded their steps."""
    if not steps:
        return "-"
    real = steps["real"]
    means = f"{_fmt(real['step_ms_mean'])}/{_fmt(steps['sim']['step_ms_mean'])}"
    return f"{means} x{real['busy_over_formula']:.2f}" if real.get("busy_over_formula") else means


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.sim_validate", description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=16, help="requests per run (default: %(default)s)")
    p.add_argument(
        "--light-rate", type=float, default=0.5, help="light load, requests/s (default: %(default)s)"
    )
    p.add_argument(
        "--heavy-rate", type=float, default=2.0, help="near saturation, requests/s (default: %(default)s)"
    )
    p.add_argument(
        "--workloads",
        type=lambda s: s.split(","),
        default=list(WORKLOADS),
        help="comma-separated (default: all three)",
    )
    p.add_argument(
        "--topologies",
        type=lambda s: s.split(","),
        default=list(TOPOLOGIES),
        help=f"comma-separated of {', '.join(TOPOLOGIES)} (default: both)",
    )
    p.add_argument(
        "--costs", default="sim/data/this_machine.json", help="cost model JSON (default: %(default)s)"
    )
    p.add_argument(
        "--tolerance", type=float, default=0.2, help="relative error target (default: %(default)s)"
    )
    p.add_argument(
        "--reps", type=int, default=1,
        help="run the real clusters this many times (a fresh start each); with 2 or more, `repeats` reports "
             "how often the real runs agree with each other within --tolerance, the ceiling their noise puts "
             "on the target, and the simulator against their mean, and `later_reps` keeps the rows of "
             "every rep after the first (default: %(default)s)",
    )
    p.add_argument(
        "--rescore", metavar="SAVED_JSON", default=None,
        help="start no cluster: simulate the runs of a saved --json result again with --costs and score them "
             "against its real measurements",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return check_least(p, p.parse_args(argv), {"reps": 1})


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.rescore:
        saved = load_result(args.rescore)
        result = rescore(saved, args.costs, args.tolerance)
    else:
        result = validate(args)
    print(json.dumps(result) if args.json else table(result))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
