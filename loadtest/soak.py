"""Soak: a bounded run at a fraction of measured capacity with a fault injected every minute.

    python -m loadtest.soak [--minutes 10] [--load 0.7] [--out loadtest/out/soak]

Not part of `make test` (it takes as long as --minutes). The run:

  1. start a cluster (1 prefill + 2 decode, SmolLM2) on local Ray and an embedded Redis;
  2. capacity: a closed loop at --capacity-concurrency for --capacity-s seconds; capacity =
     completed requests / s;
  3. soak: Poisson arrivals at --load x capacity for --minutes, a `synthetic` workload, while
     a fault is injected at the start of every minute, in turn:
        kill-decode   SIGKILL a decode worker's process (Ray restarts it under a new epoch)
        drain-decode  SIGTERM a decode worker (drain: in-flight streams finish, then restart)
        redis-down    kill the Redis server for 20 s, then start it again (empty)
        kill-prefill  SIGKILL the prefill worker's process
  4. samples: before the soak and after it, each once the cluster is idle and all three workers
     are registered (the final one waits for the last fault to heal): the router process's
     resident memory and open file descriptors, and each worker's KV blocks (used must be 0,
     free must equal the pool) and its process's RSS and fds; plus one sample under load near
     the end of every minute, for the trend.

Drift = (final - baseline) / baseline per resource. A worker a fault restarted is a new
process, so its RSS/fds drift compares a fresh process with a warmed one; soak.json lists
each worker's epoch so the reader can tell. Errors are expected only while a fault is live
(streams on a killed worker end UNAVAILABLE); every one is counted by status.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

FAULTS = ("kill-decode", "drain-decode", "redis-down", "kill-prefill")


@dataclass
class Sample:
    label: str
    router_rss: int
    router_fds: int
    redis_pid: int | None  # None: the embedded redis-server is not running
    workers: dict[str, dict[str, int]] = field(default_factory=dict)  # id -> rss, fds, used, free


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtest.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=int, default=10, help="soak duration in minutes (default: %(default)s)")
    p.add_argument("--load", type=float, default=0.7,
                   help="arrival rate as a fraction of measured capacity (default: %(default)s)")
    p.add_argument("--capacity-concurrency", type=int, default=8,
                   help="closed-loop concurrency of the capacity measurement (default: %(default)s)")
    p.add_argument("--capacity-s", type=float, default=60.0,
                   help="length of the capacity measurement, seconds (default: %(default)s)")
    p.add_argument("--input-tokens", type=int, default=200, help="mean prompt length (default: %(default)s)")
    p.add_argument("--output-tokens", type=int, default=32, help="mean output length (default: %(default)s)")
    p.add_argument("--redis-down-s", type=float, default=20.0,
                   help="how long the redis-down fault keeps Redis dead (default: %(default)s)")
    p.add_argument("--faults", default=",".join(FAULTS),
                   help="comma-separated faults injected in turn, one a minute; any of "
                        f"{', '.join(FAULTS)} (default: all, in that order)")
    p.add_argument("--out", default="loadtest/out/soak", help="output folder (default: %(default)s)")
    args = p.parse_args(argv)
    args.faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    unknown = sorted(set(args.faults) - set(FAULTS))
    if unknown or not args.faults:
        p.error(f"--faults: unknown {unknown or 'empty list'}; choose from {', '.join(FAULTS)}")
    return args


def process_usage(pid: int) -> tuple[int, int]:
    import psutil

    proc = psutil.Process(pid)
    return proc.memory_info().rss, proc.num_fds()


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        from deploy.launcher import ClusterSpec, LocalCluster

        self.args = args
        spec = ClusterSpec(num_prefill=1, num_decode=2, port=0, num_blocks=512, routing="prefix",
                           namespace="soak")
        self.cluster = LocalCluster(spec, say=lambda line: print(f"[soak] {line}", flush=True))
        self.faults: list[dict[str, Any]] = []
        self.samples: list[Sample] = []

    # --- faults -------------------------------------------------------------------------------
    def inject(self, minute: int) -> None:
        """Inject this minute's fault; a fault that cannot be injected (its worker is gone) is
        recorded as such, and the soak goes on."""
        kind, at = self.args.faults[minute % len(self.args.faults)], time.time()
        try:
            self._inject(kind, minute)
        except Exception as e:
            self.faults.append({"minute": minute, "fault": kind, "at": at, "error": f"not injected: {e}"})
            print(f"[soak] minute {minute}: could not inject {kind}: {e}", flush=True)
            return
        self.faults.append({"minute": minute, "fault": kind, "at": at})
        print(f"[soak] minute {minute}: injected {kind}", flush=True)

    def _inject(self, kind: str, minute: int) -> None:
        if kind == "redis-down":
            # NOTE: restarted from this (main) thread: redis-server dies with the thread that
            # started it, so a Timer thread would kill it again at once.
            self.cluster.redis_server.kill()
            time.sleep(self.args.redis_down_s)
            self.cluster.redis_server.start()
        else:
            worker = "prefill-0" if kind == "kill-prefill" else f"decode-{minute % 2}"
            pid = self._describe(worker)["pid"]
            os.kill(pid, signal.SIGTERM if kind == "drain-decode" else signal.SIGKILL)

    def _describe(self, worker_id: str) -> dict:
        import ray

        return ray.get(self.cluster.actors[worker_id].describe.remote(), timeout=120)

    # --- samples ------------------------------------------------------------------------------
    def sample(self, label: str, idle: bool, timeout_s: float = 180.0) -> Sample:
        """Router RSS/fds and, per worker, process RSS/fds and KV blocks. With idle=True, first
        wait until all three workers are registered and no block is in use (a leak never gets
        there: the wait times out and the sample records what it saw)."""
        deadline = time.monotonic() + timeout_s
        while True:
            statuses = self._statuses()
            settled = len(statuses) == 3 and all(s.used_blocks == 0 for s in statuses.values())
            if not idle or settled or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        rss, fds = process_usage(os.getpid())
        sample = Sample(label, rss, fds, self.cluster.redis_server.pid)
        for worker_id, status in statuses.items():
            try:
                w_rss, w_fds = process_usage(self._describe(worker_id)["pid"])
            except Exception:  # the actor is gone (Ray gave up restarting it): record what Status said
                w_rss = w_fds = 0
            sample.workers[worker_id] = {"rss": w_rss, "fds": w_fds, "used_blocks": status.used_blocks,
                                         "free_blocks": status.free_blocks, "num_blocks": status.num_blocks,
                                         "epoch": status.epoch}
        self.samples.append(sample)
        return sample

    def _statuses(self) -> dict:
        import grpc

        from protos.pdserve.v1 import worker_pb2, worker_pb2_grpc

        out = {}
        try:
            live = self.cluster.registry.live_workers()
        except Exception:  # Redis down: no view this second
            return out
        for info in live:
            with grpc.insecure_channel(info.address) as channel:
                try:
                    out[info.worker_id] = worker_pb2_grpc.WorkerStub(channel).Status(
                        worker_pb2.StatusRequest(), timeout=5)
                except grpc.RpcError:
                    pass
        return out

    # --- the run ------------------------------------------------------------------------------
    def load_config(self, router: str, arrivals, duration_s: float, requests: int, label: str):
        from loadtest.arrivals import Bounds
        from loadtest.runner import LoadTestConfig, RequestOptions
        from loadtest.workloads import Synthetic

        workload = Synthetic(input_tokens=self.args.input_tokens, output_tokens=self.args.output_tokens,
                             range_ratio=0.5)
        return LoadTestConfig(router=router, workload=workload, arrivals=arrivals,
                              bounds=Bounds(requests, duration_s), seed=len(self.samples),
                              options=RequestOptions(timeout_s=120), progress=True, label=label)

    def run(self) -> dict[str, Any]:
        import asyncio

        from loadtest.arrivals import ClosedLoop, Poisson
        from loadtest.report import write_outputs
        from loadtest.runner import run_loadtest_async

        router = self.cluster.start()
        capacity_cfg = self.load_config(router, ClosedLoop(self.args.capacity_concurrency),
                                        self.args.capacity_s, 10_000, "capacity")
        capacity = asyncio.run(run_loadtest_async(capacity_cfg)).report
        rate = max(0.05, self.args.load * (capacity["requests_per_s"] or 0.0))
        baseline = self.sample("baseline", idle=True)
        soak_s = self.args.minutes * 60.0
        expected = int(rate * soak_s * 2) + 10  # a bound for the progress bar; the duration ends the run
        soak_cfg = self.load_config(router, Poisson(rate), soak_s, expected, f"soak at {rate:.2f}/s")
        result: dict[str, Any] = {}
        runner = threading.Thread(target=lambda: result.update(
            run=asyncio.run(run_loadtest_async(soak_cfg))), name="soak-load")
        runner.start()
        started = time.monotonic()
        for minute in range(self.args.minutes):
            _sleep_until(started + minute * 60.0 + 5.0)
            self.inject(minute)
            _sleep_until(started + minute * 60.0 + 55.0)
            self.sample(f"minute {minute}", idle=False)
        runner.join()
        final = self.sample("final", idle=True)
        write_outputs(self.args.out, result["run"].report, result["run"].records)
        return self.summary(capacity, rate, result["run"].report, baseline, final)

    def summary(self, capacity, rate, report, baseline: Sample, final: Sample) -> dict[str, Any]:
        drift = {"router_rss": _drift(baseline.router_rss, final.router_rss),
                 "router_fds": _drift(baseline.router_fds, final.router_fds)}
        for worker_id, before in baseline.workers.items():
            after = final.workers.get(worker_id, {})
            for key in ("rss", "fds", "free_blocks"):
                drift[f"{worker_id}_{key}"] = _drift(before[key], after.get(key))
        leaked = {w: v["used_blocks"] for w, v in final.workers.items() if v["used_blocks"]}
        return {"capacity_requests_per_s": capacity["requests_per_s"], "soak_rate": rate,
                "minutes": self.args.minutes, "faults": self.faults,
                "counts": report["counts"], "errors": report["errors"],
                "ttft_ms": report["ttft_ms"], "itl_ms": report["itl_ms"],
                "drift": drift,
                "within_1_percent": {k: v is not None and abs(v) < 0.01 for k, v in drift.items()},
                "blocks_in_use_at_end": leaked, "workers_back": sorted(final.workers),
                "samples": [vars(s) for s in self.samples]}

    def stop(self) -> None:
        self.cluster.stop()


def _drift(before: float | None, after: float | None) -> float | None:
    if not before or after is None:
        return None
    return round((after - before) / before, 4)


def _sleep_until(t: float) -> None:
    time.sleep(max(0.0, t - time.monotonic()))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    soak = Soak(args)
    try:
        summary = soak.run()
    finally:
        soak.stop()
    with open(os.path.join(args.out, "soak.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
    print(json.dumps({k: summary[k] for k in ("capacity_requests_per_s", "soak_rate", "counts", "errors",
                                             "drift", "blocks_in_use_at_end")}, indent=2))
    return 0 if not summary["blocks_in_use_at_end"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
