"""Router replicas: throughput and decision time with 2 routers against 1, when the router is the bottleneck.

    python -m bench.routers [--json] [--quick] [--reps N] [--seconds S] [--clients N]

Cluster: LocalCluster (what `pdserve up --routers 2` starts) with 1 decode worker and no prefill
worker, on a tiny random-weight model (pdserve/engine/tiny_model.py: 2 layers, hidden 64), so a
request costs the worker well under a millisecond and the router saturates first. Requests are as
cheap as the router allows: a 1-token prompt (token ids, no chat template), max_tokens 1, greedy.

Load: --clients processes (spawned, so no client shares a GIL with a router), each with
THREADS_PER_CLIENT closed-loop threads over a PdserveClient, for --seconds after a warm-up second.
Each rep runs two phases on the same cluster, in alternating order:

  one   every client dials router-0 alone
  two   every client dials both routers (round robin per call, pdserve/router_targets.py)

Reported per phase (median over reps): requests/s (completed OK over the phase), and the routing
decision time p50/p99 across the routers that served, estimated from the routers' own
pdserve_router_decision_seconds histograms (the phase's bucket increments, linearly interpolated
inside a bucket, as Prometheus's histogram_quantile does; buckets: router/metrics.py).
Also per phase: the whole machine's CPU busy fraction (/proc/stat), which says whether a core had
time to spare for a second router, and the cores each server process used (router-0 is this
process, with the client pool's parent). Headlines: throughput_ratio = two / one (target >= 1.7), and
decision_p50_ratio / decision_p99_ratio = two / one (target <= 1: no worse with 2).

NOTE: on a 2-core machine the two routers, the worker and the client processes share two cores; a
second router can only add throughput if a core has time to spare. The load average is recorded.
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import threading
import time
import urllib.request
from typing import Any

from bench import common

THREADS_PER_CLIENT = 4
WARMUP_S = 1.0
PHASES = ("one", "two")


def client_loop(target: str, seconds: float) -> int:
    """In a client process: THREADS_PER_CLIENT closed-loop threads; the requests completed OK after
    the warm-up."""
    from pdserve.client import PdserveClient, PdserveError

    start = time.monotonic()
    counts = [0] * THREADS_PER_CLIENT

    def loop(i: int) -> None:
        with PdserveClient(target, timeout_s=30) as client:
            while (now := time.monotonic()) < start + WARMUP_S + seconds:
                try:
                    client.generate(token_ids=[42], max_tokens=1, temperature=0, ignore_eos=True)
                except PdserveError:
                    continue
                if now >= start + WARMUP_S:
                    counts[i] += 1

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(THREADS_PER_CLIENT)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts)


def decision_buckets(metrics_address: str) -> dict[float, float]:
    """The router's cumulative decision-time histogram: upper bound (s) -> count."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=5) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        if family.name == "pdserve_router_decision_seconds":
            return {float(s.labels["le"]): s.value for s in family.samples if s.name.endswith("_bucket")}
    return {}


def quantile(buckets: dict[float, float], q: float) -> float | None:
    """histogram_quantile over cumulative buckets (seconds); None when empty."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0
    if not total:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for bound in bounds:
        if buckets[bound] >= rank:
            if bound == float("inf"):
                return lower
            inside = buckets[bound] - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = bound, buckets[bound]
    return lower


def busy_jiffies() -> tuple[int, int]:
    """(busy, total) CPU time of the whole machine so far, from /proc/stat."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values) - idle, sum(values)


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used, from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_pids(cluster) -> dict[str, int]:
    """router-0 (this process), the replicas and the workers, by name."""
    import ray

    pids = {"router-0": os.getpid(), **{name: i["pid"] for name, i in cluster.replica_info.items()}}
    for name, actor in cluster.actors.items():
        pids[name] = ray.get(actor.describe.remote(), timeout=60)["pid"]
    return pids


def phase(cluster, phase_name: str, args: Any) -> dict[str, Any]:
    routers = [cluster.router.metrics_address, *(i["metrics_address"] for i in cluster.replica_info.values())]
    target = cluster.router.address if phase_name == "one" else cluster.addresses
    pids = server_pids(cluster)
    before, cpu_before = [decision_buckets(m) for m in routers], busy_jiffies()
    used_before = {name: process_cpu_s(pid) for name, pid in pids.items()}
    started = time.monotonic()
    with multiprocessing.get_context("spawn").Pool(args.clients) as pool:
        done = sum(pool.starmap(client_loop, [(target, args.seconds)] * args.clients))
    elapsed = time.monotonic() - started
    after, cpu_after = [decision_buckets(m) for m in routers], busy_jiffies()
    cores = {name: (process_cpu_s(pid) - used_before[name]) / elapsed for name, pid in pids.items()}
    merged: dict[float, float] = {}
    for b, a in zip(before, after):
        for bound, count in a.items():
            merged[bound] = merged.get(bound, 0.0) + count - b.get(bound, 0.0)
    p50, p99 = quantile(merged, 0.5), quantile(merged, 0.99)
    busy = (cpu_after[0] - cpu_before[0]) / max(1, cpu_after[1] - cpu_before[1])
    return {"requests_per_s": done / args.seconds, "requests": done, "cpu_busy_fraction": busy,
            "cores_used": cores,
            "decision_p50_ms": None if p50 is None else 1e3 * p50,
            "decision_p99_ms": None if p99 is None else 1e3 * p99}


def run(args: Any) -> dict[str, Any]:
    from deploy.config import ClusterSpec
    from deploy.launcher import LocalCluster
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.tiny_model import write_tiny_model

    load_at_start = common.warn_if_busy(len(os.sched_getaffinity(0)))
    reps: list[dict[str, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-routers-") as model:
        write_tiny_model(model)
        spec = ClusterSpec(engine=EngineConfig(model_path=model), num_prefill=0, num_decode=1, num_routers=2,
                           port=0, http_port=0, namespace="bench-routers")
        cluster = LocalCluster(spec, say=lambda line: common.progress(f"cluster: {line}"))
        try:
            cluster.start()
            for rep in range(args.reps):
                order = PHASES if rep % 2 == 0 else PHASES[::-1]
                results = {}
                for name in order:
                    common.progress(f"rep {rep + 1}/{args.reps}: {name} router(s), {args.clients} clients x "
                             f"{THREADS_PER_CLIENT} threads, {args.seconds:g} s")
                    results[name] = phase(cluster, name, args)
                    common.progress(f"  {results[name]['requests_per_s']:.0f} requests/s")
                reps.append(results)
        finally:
            cluster.stop()
    return summarize(reps, args, load_at_start)


def summarize(reps: list[dict[str, dict[str, Any]]], args: Any, load: float) -> dict[str, Any]:
    def med(name: str, key: str) -> float:
        return common.median([r[name][key] for r in reps if r[name][key] is not None])

    result: dict[str, Any] = {f"{name}_{key}": med(name, key) for name in PHASES
                              for key in ("requests_per_s", "decision_p50_ms", "decision_p99_ms",
                                          "cpu_busy_fraction")}
    result["throughput_ratio"] = common.median([r["two"]["requests_per_s"] / r["one"]["requests_per_s"]
                                         for r in reps])
    result["decision_p50_ratio"] = result["two_decision_p50_ms"] / result["one_decision_p50_ms"]
    result["decision_p99_ratio"] = result["two_decision_p99_ms"] / result["one_decision_p99_ms"]
    result["reps"] = reps
    result["sizes"] = {"reps": args.reps, "seconds": args.seconds, "clients": args.clients,
                       "threads_per_client": THREADS_PER_CLIENT}
    result["environment"] = {**common.environment(os.cpu_count() or 1), "loadavg_at_start": load,
                             "loadavg_at_end": os.getloadavg()[0]}
    return result


def report(r: dict[str, Any]) -> str:
    rows = [[name, r[f"{name}_requests_per_s"], r[f"{name}_decision_p50_ms"], r[f"{name}_decision_p99_ms"],
             r[f"{name}_cpu_busy_fraction"]] for name in PHASES]
    rows.append(["two / one", r["throughput_ratio"], r["decision_p50_ratio"], r["decision_p99_ratio"], ""])
    s, env = r["sizes"], r["environment"]
    head = (f"reps={s['reps']} clients={s['clients']}x{s['threads_per_client']} {s['seconds']:g} s a phase; "
            f"load average {env['loadavg_at_start']:.2f} -> {env['loadavg_at_end']:.2f}")
    last = r["reps"][-1]
    cores = "; ".join(f"{name}: " + ", ".join(f"{p} {c:.2f}" for p, c in last[name]["cores_used"].items())
                      for name in PHASES)
    headers = ["routers (median over reps)", "requests/s", "decision p50 ms", "decision p99 ms",
               "machine CPU busy"]
    return "\n".join([head, common.format_table(headers, rows),
                      f"cores used by each process, last rep: {cores}"])


def parse_args(argv: list[str] | None = None) -> Any:
    p = common.bench_parser("python -m bench.routers", __doc__)
    p.add_argument("--quick", action="store_true", help="smoke run: 1 rep of 3 s a phase, 2 clients")
    p.add_argument("--reps", type=int, default=None, help="reps, each both phases (default 3)")
    p.add_argument("--seconds", type=float, default=None, help="measured seconds a phase (default 10)")
    p.add_argument("--clients", type=int, default=None,
                   help=f"client processes, {THREADS_PER_CLIENT} closed-loop threads each (default 4)")
    args = common.check_least(p, p.parse_args(argv), {"reps": 1, "seconds": 1, "clients": 1})
    quick = args.quick
    args.reps = args.reps or (1 if quick else 3)
    args.seconds = args.seconds or (3.0 if quick else 10.0)
    args.clients = args.clients or (2 if quick else 4)
    return args


def main(argv: list[str] | None = None) -> None:
    common.run_timed(run, report, parse_args(argv))


if __name__ == "__main__":
    main()
