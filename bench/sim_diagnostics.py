"""Measurements behind the simulator's validation (docs/simulator.md): is this machine steady, do
two workers' engines slow each other down on it, and where does the real cluster's CPU go?

    python -m bench.sim_diagnostics drift [--probes N] [--every S] [--threads T] [--json]
    python -m bench.sim_diagnostics pair [--threads T] [--json]
    python -m bench.sim_diagnostics cpu [--workload W] [--rate R] [--requests N] [--json]
    python -m bench.sim_diagnostics outside [--topology T] [--workload W] [--rates R,R] [--requests N]
                                            [--costs FILE] [--json]
    python -m bench.sim_diagnostics tail --result FILE --cell "TOPOLOGY WORKLOAD RATE" [--costs FILE]
                                         [--draws N] [--json]
    python -m bench.sim_diagnostics fit --result FILE --out COSTS [--costs FILE] [--slowdown S] [--json]
    python -m bench.sim_diagnostics overlap --result FILE [--costs FILE] [--json]

drift  one in-process engine (SmolLM2, the cluster's EngineConfig at --threads) times a 128-token
       prefill and the median batch-1 decode step of 10, --probes times, --every seconds apart, on
       an otherwise idle machine: how far the machine's speed moves from minute to minute, which
       bounds how closely any cost file calibrated at one moment can predict a run at another.
pair   two engine processes (each at --threads) time a probe: the batch-1 and batch-4 decode steps
       (medians of 10) and a 128-token prefill. In each of 4 rounds engine 0 probes alone while
       engine 1 waits, then both probe together; the ratio of engine 0's medians, together ÷ alone,
       is what two workers on one machine cost each other. Interleaving the two phases keeps the
       machine's drift (above) out of the ratio, which a run alone followed by a run together let in.

cpu    the real cluster of the validation (2 colocated workers, `pdserve up`'s LocalCluster) runs one
       bench.sim_validate workload at --rate; before and after, every process's CPU seconds (by
       pid: kernel threads change names) and the workers' engine steps (WorkerStatus). It reports
       the run's wall time, the workers' busy seconds (the sum of their steps' wall time) and CPU
       seconds by group: the workers, this process (the router and the load tester run here), and
       every other process by name. Busy above the workers' CPU is time their steps spent off a core.
outside
       the real cluster of the validation (--topology) runs one bench.sim_validate workload at each
       of --rates, --requests each, and splits every request's TTFT at the client into the workers'
       part (the prefill_ms and transfer_ms in the router's timings: on a decode worker, from its
       handler's start to its first reply) and the rest (sim/calibrate_cluster.py
       outside_the_workers): the router, the hops, and a call's wait before a worker's handler runs.
       The simulator gives every request the same rest: the cost file's request.overhead_s. Each rate
       gets its own seed (20, 21, ...): the cluster keeps its prefix cache between runs.
tail   what sets a cell's ITL tail, from a saved `bench.sim_validate --json` result (no cluster): for
       each real rep of the cell (its `steps.real.trace`) and for --draws of the simulator on the
       same requests (draw 0 is the validation's own; draw d uses seed + 1000 d for the step spread
       and the router), the steps with a prefill chunk, those that prefill two prompts or more at
       once, the share of ITL samples that fall in a step with a prefill (a step gives one sample
       per decoding sequence), and the ITL p99 those samples give beside the one measured. An ITL
       p99 is a prefill step when that share is above 1%, a decode-only step when below.
fit    the step formula fitted to a saved result's own real steps (every rep's `steps.real.trace`),
       written to --out with the rest (transfer, hardware, request overhead) of --costs (default:
       the result's): the best the model's step formula can do on those very runs. Rescore the
       result with it (`bench.sim_validate --rescore FILE --costs COSTS`) to see how many misses a
       better calibration could remove; the fit's own relative error says how much of a step's time
       its shape does not explain. With --slowdown S each step's time is first divided by 1 + S x
       the share of it another worker was stepping too (overlap, below), and the file keeps S as
       its shared_machine_slowdown: the simulator then stretches overlapping steps itself.
overlap
       do two workers' steps slow each other down in a running cluster? For a saved result whose
       step traces carry each step's worker and start (results from 2026-12-06 22:30 on), each real
       step's time over the cost file's formula for it, against the share of it during which another
       worker was stepping too: the median ratio by that share, and the line ratio = a (1 + s share)
       fitted to all steps. s is the slowdown an overlap costs (the cost model's
       shared_machine_slowdown); an --in-cluster cost file has it at 0 and the average overlap of its
       calibration loads inside its prices.

Each engine of drift and pair runs in a child process of its own (spawned), so the parent's torch
threads and memory do not count. Ratios are together ÷ alone, and max ÷ min over the drift probes.
"""

from __future__ import annotations

import argparse
import bisect
import json
import multiprocessing
import os
import statistics
import time
from typing import Any

from bench.common import environment, progress
from bench.sim_validate import (
    TOPOLOGIES,
    WORKLOADS,
    every_rep,
    load_result,
    real_trace,
    trace_shape,
    trace_span,
)

PREFILL_TOKENS = 128
DECODE_STEPS = 30
PAIR_ROUNDS, PAIR_DECODE_STEPS = 4, 10
OUTSIDE_SEED = 20  # the outside run's first rate; bench.sim_validate's runs use 10-15


def _engine(threads: int) -> Any:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.sequence import SamplingParams

    engine = LLMEngine.from_config(EngineConfig(num_threads=threads), progress=False)
    warm_up = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.generate([list(range(1000, 1100))], warm_up, detokenize=False)
    return engine


def _decode_step_ms(engine: Any, batch: int, steps: int = DECODE_STEPS) -> float:
    from pdserve.engine.sequence import SamplingParams

    engine.pool.reset_cache()
    for i in range(batch):
        engine.add_request([3000 + 11 * i + j for j in range(100)],
                           SamplingParams(max_tokens=steps + 1, ignore_eos=True), detokenize=False)
    engine.step()  # the prefill
    times = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _prefill_ms(engine: Any, reps: int = 3) -> float:
    from pdserve.engine.sequence import SamplingParams

    times = []
    for i in range(reps):
        engine.pool.reset_cache()
        engine.add_request([5000 + 13 * i + j for j in range(PREFILL_TOKENS)],
                           SamplingParams(max_tokens=1, ignore_eos=True), detokenize=False)
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _drift_child(threads: int, probes: int, every_s: float, out: Any) -> None:
    engine = _engine(threads)
    rows = []
    for _ in range(probes):
        rows.append({"at": time.strftime("%H:%M:%S"), "prefill_ms": _prefill_ms(engine, reps=1),
                     "decode_step_ms": _decode_step_ms(engine, 1, steps=10)})
        time.sleep(every_s)
    out.put(rows)


def _pair_child(index: int, threads: int, rounds: int, ready: Any, barrier: Any, out: Any) -> None:
    """Rounds of two phases: engine 0 alone (engine 1 waits at the barrier), then both together.
    Alone and together alternate within the same two processes, so the machine's minute-to-minute
    drift falls on both sides of the ratio alike."""
    engine = _engine(threads)
    ready.put(True)
    alone, together = [], []
    for _ in range(rounds):
        barrier.wait()
        if index == 0:
            alone.append(_pair_probe(engine))
        barrier.wait()
        together.append(_pair_probe(engine))
    out.put((index, alone, together))


def _pair_probe(engine: Any) -> dict[str, float]:
    return {"decode1_ms": _decode_step_ms(engine, 1, steps=PAIR_DECODE_STEPS),
            "decode4_ms": _decode_step_ms(engine, 4, steps=PAIR_DECODE_STEPS),
            "prefill_ms": _prefill_ms(engine, reps=1)}


def _run_pair(threads: int, rounds: int) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    """Engine 0's probes alone and together (see _pair_child)."""
    ctx = multiprocessing.get_context("spawn")
    ready, out, barrier = ctx.Queue(), ctx.Queue(), ctx.Barrier(2)
    children = [ctx.Process(target=_pair_child, args=(i, threads, rounds, ready, barrier, out), daemon=True)
                for i in range(2)]
    for c in children:
        c.start()
    for _ in children:  # model loading and warm-up are not timed
        ready.get(timeout=300)
    results = dict((i, (a, t)) for i, a, t in (out.get(timeout=900) for _ in children))
    for c in children:
        c.join(timeout=30)
    return results[0]


def drift(args: argparse.Namespace) -> dict[str, Any]:
    progress(f"drift: {args.probes} probes, {args.every} s apart, {args.threads} torch thread(s)")
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=_drift_child, args=(args.threads, args.probes, args.every, out), daemon=True)
    child.start()
    rows = out.get(timeout=600 + args.probes * (args.every + 10))
    child.join(timeout=30)
    pre, dec = [r["prefill_ms"] for r in rows], [r["decode_step_ms"] for r in rows]
    return {"probes": rows, "prefill_ms_min": min(pre), "prefill_ms_max": max(pre),
            "prefill_max_over_min": max(pre) / min(pre), "decode_step_ms_min": min(dec),
            "decode_step_ms_max": max(dec), "decode_max_over_min": max(dec) / min(dec)}


def pair(args: argparse.Namespace) -> dict[str, Any]:
    return measure_pair(args.threads)


def measure_pair(threads: int, rounds: int = PAIR_ROUNDS, say: Any = progress) -> dict[str, Any]:
    """The pair measurement (the module's docstring); `pdserve sim calibrate` uses it too."""
    say(f"pair: {rounds} rounds of one engine alone, then two together, {threads} torch thread(s) each")
    alone, together = _run_pair(threads, rounds)
    medians = {which: {k: statistics.median(p[k] for p in probes) for k in probes[0]}
               for which, probes in (("alone", alone), ("together", together))}
    alone_ms, together_ms = medians["alone"], medians["together"]
    ratios = {f"{k}_together_over_alone": together_ms[k] / alone_ms[k] for k in alone_ms}
    return {**medians, "rounds": rounds, **ratios}


def cpu(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    from sim.real import Load, real_cluster, run_load, step_totals

    with real_cluster("2 colocated", say=lambda line: progress(f"cpu: {line}")) as (cluster, router):
        workers = {ray.get(a.describe.remote(), timeout=60)["pid"] for a in cluster.actors.values()}
        progress(f"cpu: {args.workload} at {args.rate}/s, {args.requests} requests")
        cpu_before, (steps_before, busy_before), start = _cpu_seconds(workers), step_totals(cluster), \
            time.perf_counter()
        run_load(router, Load(args.workload, WORKLOADS[args.workload], args.rate, args.requests, 11), "cpu")
        wall = time.perf_counter() - start
        cpu_after, (steps_after, busy_after) = _cpu_seconds(workers), step_totals(cluster)
    by_group: dict[str, float] = {}
    for (group, pid), seconds in cpu_after.items():
        if (group, pid) in cpu_before:
            by_group[group] = by_group.get(group, 0.0) + seconds - cpu_before[(group, pid)]
    return {"workload": args.workload, "rate": args.rate, "requests": args.requests, "wall_s": round(wall, 2),
            "cores": os.cpu_count(), "steps": steps_after - steps_before,
            "workers_busy_s": round(busy_after - busy_before, 2),
            "cpu_s": {g: round(s, 2) for g, s in sorted(by_group.items(), key=lambda kv: -kv[1])
                      if s >= 0.01}}


def outside(args: argparse.Namespace) -> dict[str, Any]:
    from sim.calibrate_cluster import outside_the_workers
    from sim.costs import load_costs
    from sim.real import Load, real_cluster, run_load

    runs = []
    with real_cluster(args.topology, say=lambda line: progress(f"outside: {line}")) as (_, router):
        for i, rate in enumerate(args.rates):
            progress(f"outside: {args.workload} at {rate}/s, {args.requests} requests")
            load = Load(args.workload, WORKLOADS[args.workload], rate, args.requests, OUTSIDE_SEED + i)
            records = run_load(router, load, "outside").records
            seconds = [s for s in map(outside_the_workers, records) if s is not None]
            runs.append({"rate": rate, "load_average_1m": round(os.getloadavg()[0], 2),
                         "outside_ms": outside_summary(seconds)})
    overhead = load_costs(args.costs).request.overhead_s
    return {"topology": args.topology, "workload": args.workload, "requests": args.requests, "runs": runs,
            "costs": args.costs, "simulated_overhead_ms": round(1000 * overhead, 2)}


def outside_summary(seconds: list[float]) -> dict[str, float | int | None]:
    """Milliseconds outside the workers, as loadtest's reports give latencies (p50, p90, p99, mean, max)."""
    from loadtest.stats import summarize

    return summarize([1000 * s for s in seconds])


def tail(args: argparse.Namespace) -> dict[str, Any]:
    saved = load_result(args.result)
    rows = [row for row in every_rep(saved)
            if f"{row['topology']} {row['workload']} {row['rate']:g}" == args.cell]
    if not rows:
        raise SystemExit(f"{args.result} has no cell {args.cell!r}: give it as 'TOPOLOGY WORKLOAD RATE', "
                         f"for example '1P+1D multi-turn 2' (its runs' topology, workload and rate)")
    real = []
    for row in rows:
        trace = real_trace(row)
        if trace:
            steps = [(trace_shape(t), t[3]) for t in trace]
            real.append({**step_tail(steps), "itl_p99_ms": row["metrics"]["itl_p99_ms"]["real"]})
    costs = args.costs or saved["costs"]
    row = rows[0]
    simulated = [_simulated_tail(row, saved["requests_per_run"], costs, draw) for draw in range(args.draws)]
    return {"result": args.result, "cell": args.cell, "requests": saved["requests_per_run"], "costs": costs,
            "real": real, "simulated": simulated}


def _simulated_tail(row: dict[str, Any], requests: int, costs_path: str, draw: int) -> dict[str, Any]:
    from loadtest.stats import SLO, build_report
    from loadtest.workloads import make_workload
    from sim.cluster import ClusterShape, simulate
    from sim.costs import load_costs
    from sim.workload import from_workload

    reqs = from_workload(make_workload(row["workload"], WORKLOADS[row["workload"]]), requests, row["rate"],
                         row["seed"])
    shape = ClusterShape(*TOPOLOGIES[row["topology"]], routing="prefix")
    result = simulate(reqs, shape, load_costs(costs_path), row["seed"] + 1000 * draw, trace_steps=True)
    report = build_report(result.records, duration_s=result.duration_s, slo=SLO())
    return {**step_tail([(s.shape, s.seconds) for s in result.steps_trace]),
            "itl_p99_ms": report["itl_ms"]["p99"]}


def fit(args: argparse.Namespace) -> dict[str, Any]:
    from dataclasses import replace

    import numpy as np

    from sim.calibrate import features, fit_step_costs
    from sim.costs import load_costs, save_costs

    saved = load_result(args.result)
    traces = [real_trace(row) for row in every_rep(saved)]
    trace = [t for run in traces for t in run]
    if not trace:
        raise SystemExit(f"{args.result} keeps no real step trace (results written before 2026-12-06 15:13 "
                         "have none): run bench.sim_validate again")
    if args.slowdown and any(trace_span(t) is None for t in trace):
        raise SystemExit(f"--slowdown needs each step's worker and start, which {args.result} does not keep "
                         "(results from 2026-12-06 22:30 on do): run bench.sim_validate again")
    shares = [s for run in traces for s in overlap_shares([trace_span(t) for t in run])] \
        if args.slowdown else [0.0] * len(trace)
    stretch = 1 + args.slowdown * np.array(shares)  # the time another worker's steps added (the model's)
    shapes, times = [trace_shape(t) for t in trace], np.array([t[3] for t in trace])
    step, _ = fit_step_costs([features(shape) for shape in shapes], list(times / stretch))
    costs = args.costs or saved["costs"]
    base = load_costs(costs)
    source = {**{k: v for k, v in base.source.items() if k != "samples"},  # the calibration's, not these
              "note": f"step costs fitted to the real steps of {args.result} (bench.sim_diagnostics fit, "
                      f"slowdown {args.slowdown:g}): in-sample, not a calibration"}
    model = replace(base, step=replace(step, shared_machine_slowdown=args.slowdown), source=source)
    save_costs(model, args.out)
    formula = [model.step_s(list(s.prefill), s.decode_seqs, s.decode_context) for s in shapes]
    fitted = np.array(formula) * stretch
    relative = np.abs(fitted - times) / times
    return {"result": args.result, "costs": costs, "out": args.out, "steps": len(trace),
            "slowdown": args.slowdown, "fit_relative_error_median": round(float(np.median(relative)), 3),
            "fit_relative_error_p90": round(float(np.percentile(relative, 90)), 3)}


OVERLAP_BINS = ((0.0, 0.05), (0.05, 0.5), (0.5, 0.95), (0.95, 1.01))  # [low, high) shares of a step


def overlap(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np

    from sim.costs import load_costs

    saved = load_result(args.result)
    costs = load_costs(args.costs or saved["costs"])
    runs, shares, ratios = [], [], []
    for row in every_rep(saved):
        trace = [t for t in real_trace(row) if trace_span(t) is not None]
        if not trace:
            continue
        share = overlap_shares([trace_span(t) for t in trace])
        ratio = [span[2] / costs.step_s(list(s.prefill), s.decode_seqs, s.decode_context)
                 for span, s in zip(map(trace_span, trace), map(trace_shape, trace))]
        shares += share
        ratios += ratio
        cell = f"{row['topology']} {row['workload']} {row['rate']:g}"
        runs.append({"cell": cell, **overlap_summary(share, ratio)})
    if not runs:
        raise SystemExit(f"{args.result} keeps no step starts (results from 2026-12-06 22:30 on have them): "
                         "run bench.sim_validate again")
    a, b = np.polyfit(np.array(shares), np.array(ratios), 1)[::-1]
    return {"result": args.result, "costs": args.costs or saved["costs"], "runs": runs,
            "all": {**overlap_summary(shares, ratios), "fitted_a": round(float(a), 3),
                    "fitted_slowdown": round(float(b / a), 3)}}


def overlap_shares(steps: list[tuple[str, float, float]]) -> list[float]:
    """(worker, start, seconds) of steps -> for each, the share of its time during which another
    worker was running a step (0..1; with several others, the time any one of them was)."""
    by_worker: dict[str, list[tuple[float, float]]] = {}
    for worker, start, seconds in steps:
        by_worker.setdefault(worker, []).append((start, start + seconds))
    for spans in by_worker.values():
        spans.sort()
    out = []
    for worker, start, seconds in steps:
        end, covered = start + seconds, []
        for other, spans in by_worker.items():
            if other == worker:
                continue
            i = max(0, bisect.bisect_left(spans, (start, start)) - 1)
            while i < len(spans) and spans[i][0] < end:
                lo, hi = max(start, spans[i][0]), min(end, spans[i][1])
                if hi > lo:
                    covered.append((lo, hi))
                i += 1
        out.append(_covered_seconds(covered) / seconds if seconds > 0 else 0.0)
    return out


def _covered_seconds(spans: list[tuple[float, float]]) -> float:
    total, reach = 0.0, float("-inf")
    for lo, hi in sorted(spans):
        if hi > reach:
            total += hi - max(lo, reach)
            reach = hi
    return total


def overlap_summary(shares: list[float], ratios: list[float]) -> dict[str, Any]:
    """Steps, their mean share overlapped, and the median time ÷ formula in each OVERLAP_BINS bin."""
    bins = {}
    for low, high in OVERLAP_BINS:
        inside = [r for s, r in zip(shares, ratios) if low <= s < high]
        median = round(statistics.median(inside), 3) if inside else None
        bins[f"{low:g}-{min(high, 1):g}"] = {"steps": len(inside), "median_ratio": median}
    return {"steps": len(shares), "mean_share": round(statistics.fmean(shares), 3) if shares else None,
            "by_share": bins}


def step_tail(steps: list[tuple[Any, float]]) -> dict[str, Any]:
    """(StepShape, seconds) of a run's steps -> what sets its ITL tail (the tail command above). The
    ITL p99 from steps is the sample at rank ceil(0.99 n) of the n samples, sorted."""
    samples = sorted((seconds, bool(shape.prefill))
                     for shape, seconds in steps for _ in range(shape.decode_seqs))
    in_prefill = sum(with_prefill for _, with_prefill in samples)
    p99 = samples[max(0, -(-99 * len(samples) // 100) - 1)][0] if samples else None
    return {"steps": len(steps), "steps_with_prefill": sum(bool(shape.prefill) for shape, _ in steps),
            "steps_prefilling_two_or_more": sum(len(shape.prefill) >= 2 for shape, _ in steps),
            "itl_samples": len(samples),
            "share_of_itl_samples_in_prefill_steps": round(in_prefill / len(samples), 4) if samples else None,
            "itl_p99_from_steps_ms": None if p99 is None else round(1000 * p99, 1)}


def _cpu_seconds(workers: set[int]) -> dict[tuple[str, int], float]:
    """(group, pid) -> user + system CPU seconds of every process on the machine."""
    import psutil

    out = {}
    for p in psutil.process_iter(["name"]):
        try:
            times = p.cpu_times()
        except psutil.Error:
            continue
        group = ("workers" if p.pid in workers else "this process (router, load tester)"
                 if p.pid == os.getpid() else p.info["name"])
        out[(group, p.pid)] = times.user + times.system
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.sim_diagnostics", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("drift", help="how far this machine's speed moves from minute to minute")
    d.add_argument("--probes", type=int, default=12, help="timed probes (default: %(default)s)")
    d.add_argument("--every", type=float, default=8.0, help="seconds between probes (default: %(default)s)")
    q = sub.add_parser("pair", help="what two engines on this machine cost each other")
    c = sub.add_parser("cpu", help="where the real cluster's CPU goes during a run")
    c.add_argument("--workload", default="synthetic", choices=sorted(WORKLOADS),
                   help="a bench.sim_validate workload (default: %(default)s)")
    c.add_argument("--rate", type=float, default=1.5, help="requests/s (default: %(default)s)")
    c.add_argument("--requests", type=int, default=16, help="requests in the run (default: %(default)s)")
    c.add_argument("--json", action="store_true", help="print one JSON object")
    o = sub.add_parser("outside", help="each request's time outside the workers, by request rate")
    o.add_argument("--topology", default="1P+1D", choices=list(TOPOLOGIES),
                   help="the validation's cluster shape (default: %(default)s)")
    o.add_argument("--workload", default="shared-prefix", choices=sorted(WORKLOADS),
                   help="a bench.sim_validate workload (default: %(default)s)")
    o.add_argument("--rates", type=lambda text: [float(r) for r in text.split(",")], default=[0.5, 2.0],
                   help="requests/s, comma-separated, one run each (default: 0.5,2.0, the validation's)")
    o.add_argument("--requests", type=int, default=40, help="requests a run (default: %(default)s)")
    o.add_argument("--costs", default="sim/data/this_machine.json",
                   help="the cost file whose request.overhead_s is reported beside (default: %(default)s)")
    o.add_argument("--json", action="store_true", help="print one JSON object")
    t = sub.add_parser("tail", help="what sets a cell's ITL tail: real steps, simulated draws (no cluster)")
    t.add_argument("--result", required=True, help="a saved `python -m bench.sim_validate --json` result")
    t.add_argument("--cell", required=True,
                   help="'TOPOLOGY WORKLOAD RATE' as the result's runs give them, e.g. '1P+1D multi-turn 2'")
    t.add_argument("--costs", default=None, help="cost file for the simulated draws (default: the result's)")
    t.add_argument("--draws", type=int, default=9,
                   help="simulated draws of the step spread; draw 0 is the validation's "
                        "(default: %(default)s)")
    t.add_argument("--json", action="store_true", help="print one JSON object")
    f = sub.add_parser("fit", help="the step formula fitted to a saved result's own real steps (no cluster)")
    f.add_argument("--result", required=True, help="a saved `python -m bench.sim_validate --json` result")
    f.add_argument("--out", required=True, help="where to write the fitted cost file")
    f.add_argument("--costs", default=None,
                   help="cost file whose transfer, hardware and request costs the fitted file keeps "
                        "(default: the result's)")
    f.add_argument("--slowdown", type=float, default=0.0,
                   help="fit with this shared_machine_slowdown: each step's time over 1 + slowdown x the "
                        "share of it another worker was stepping too (needs a result with step starts; "
                        "default: %(default)s, the prices keep the contention averaged in)")
    f.add_argument("--json", action="store_true", help="print one JSON object")
    v = sub.add_parser("overlap", help="do two workers' steps slow each other down in a running cluster?")
    v.add_argument("--result", required=True, help="a saved `python -m bench.sim_validate --json` result")
    v.add_argument("--costs", default=None,
                   help="cost file whose formula prices the steps (default: the result's)")
    v.add_argument("--json", action="store_true", help="print one JSON object")
    for s in (d, q):
        s.add_argument("--threads", type=int, default=1,
                       help="torch threads of each engine, as each of two workers gets "
                            "(default: %(default)s)")
        s.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    if getattr(args, "threads", 1) < 1 or getattr(args, "probes", 1) < 1 or getattr(args, "every", 0) < 0:
        p.error("--threads and --probes must be >= 1 and --every >= 0")
    if getattr(args, "draws", 1) < 1:
        p.error(f"--draws must be >= 1, got {args.draws}")
    if getattr(args, "slowdown", 0.0) < 0:
        p.error(f"--slowdown must be >= 0, got {args.slowdown}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    commands = {"drift": drift, "pair": pair, "cpu": cpu, "outside": outside, "tail": tail, "fit": fit,
                "overlap": overlap}
    measured = commands[args.command](args)
    result = {**measured, "environment": environment(getattr(args, "threads", 1))}
    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps({k: v for k, v in result.items() if k not in ("probes", "environment")}, indent=2))


if __name__ == "__main__":
    main()
