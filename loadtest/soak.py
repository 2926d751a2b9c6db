"""Soak: a bounded run at a fraction of measured capacity with a fault injected every minute.

    python -m loadtest.soak [--minutes 10] [--load 0.7] [--out loadtest/out/soak]

Not part of `make test` (it takes as long as --minutes). The run:

  1. start a cluster (2 prefill + 3 decode, SmolLM2) on local Ray and an embedded Redis;
  2. capacity: a closed loop at --capacity-concurrency for --capacity-s seconds; capacity =
     completed requests / s;
  3. warm-up, then soak: Poisson arrivals at --load x capacity, a `synthetic` workload, for
     --warmup-minutes and then for --minutes, while a fault is injected at the start of every
     minute, in turn (--faults picks which):
        kill-decode   SIGKILL decode-0 or decode-1 (in turn); Ray restarts it, new epoch
        drain-decode  SIGTERM decode-0 or decode-1 (drain: in-flight streams finish, restart)
        redis-down    kill the Redis server for --redis-down-s, then start it again (empty)
        kill-prefill  SIGKILL prefill-0
        none          nothing (a control run: --faults none)
     The warm-up (by default one minute per fault) is there so that what a fault path costs
     the first time it runs (an allocator's high-water mark under a new mix of shapes, a
     decode worker's first replay) is paid before the baseline: drift is what keeps growing.
     prefill-1 and decode-2 are never killed: they live through every fault's effects (aborted
     transfers, retries sent their way, Redis gone), so their drift is that of a process that
     served the whole soak. Every load run is `python -m loadtest` in a process of its own,
     as a real client is, so the router's figures (this process: router, Ray driver, sampler)
     exclude the client; their reports land in OUT/capacity/, OUT/warmup/ and OUT/soak/.
  4. samples: after the warm-up (the baseline) and after the soak, each once the cluster is
     idle and every worker is registered (each waits for the last fault to heal), after
     release_free_heap() in this process (gc, then malloc_trim, so that RSS counts live
     memory): the router process's resident memory and open descriptors (and those by kind),
     and per worker its KV blocks (used must be 0, free must equal the pool), pid, epoch, RSS
     and descriptors; plus one sample under load near the end of every minute.

Drift = (final - baseline) / baseline per resource. The target (< 1%) is judged on the router
and on every worker process that lived through the soak; a worker a fault restarted is a new
process, so its figures are listed but not judged. KV blocks are judged on every worker. Each
failed request is attributed to the last fault injected before it ended.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
import tracemalloc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtest.process_stats import Peers, process_usage, release_free_heap, write_memory_growth

FAULTS = ("kill-decode", "drain-decode", "redis-down", "kill-prefill")
CONTROL = "none"
REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Sample:
    label: str
    router_rss: int
    router_fds: int
    router_fd_kinds: dict[str, int]
    redis_pid: int | None  # None: the embedded redis-server is not running
    # worker id -> pid, rss, fds, fd_kinds, used_blocks, free_blocks, num_blocks, epoch
    workers: dict[str, dict[str, Any]] = field(default_factory=dict)


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
                        f"{', '.join(FAULTS + (CONTROL,))} (default: the first four, in that order)")
    p.add_argument("--warmup-minutes", type=int, default=None,
                   help="minutes of the same load and faults before the baseline sample, so that what "
                        "each fault path costs once (allocator high-water marks, a decode worker's "
                        "first replay) is not counted as drift "
                        "(default: one per fault in --faults; 0: none)")
    p.add_argument("--trace-memory", action="store_true",
                   help="trace Python allocations in this process (router, Ray driver, sampler) with "
                        "tracemalloc and write the 25 biggest growths from baseline to the end to "
                        "OUT/tracemalloc.txt; slows the router somewhat")
    p.add_argument("--out", default="loadtest/out/soak", help="output folder (default: %(default)s)")
    args = p.parse_args(argv)
    args.faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    unknown = sorted(set(args.faults) - set(FAULTS + (CONTROL,)))
    if unknown or not args.faults:
        p.error(f"--faults: unknown {unknown or 'empty list'}; choose from {', '.join(FAULTS + (CONTROL,))}")
    if args.warmup_minutes is None:
        args.warmup_minutes = len(args.faults)
    if args.warmup_minutes < 0 or args.minutes < 1:
        p.error("--minutes must be at least 1 and --warmup-minutes at least 0")
    return args


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        from deploy.launcher import ClusterSpec, LocalCluster
        from pdserve.engine.config import CacheConfig, EngineConfig
        from router.config import PlacementConfig

        self.args = args
        spec = ClusterSpec(num_prefill=2, num_decode=3, port=0,
                           engine=EngineConfig(cache=CacheConfig(num_blocks=512)),
                           placement=PlacementConfig(routing="prefix"), namespace="soak")
        self.cluster = LocalCluster(spec, say=lambda line: print(f"[soak] {line}", flush=True))
        self.faults: list[dict[str, Any]] = []
        self.samples: list[Sample] = []
        self.load_proc: subprocess.Popen | None = None
        self.router = ""

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
        if kind == CONTROL:
            return
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
        wait until every worker is registered and no block is in use (a leak never gets there:
        the wait times out and the sample records what it saw), open every KV channel
        (touch_every_pair), wait again, and release this process's free heap."""
        if idle:
            self._wait_settled(timeout_s)
            self.touch_every_pair()
            statuses = self._wait_settled(timeout_s)
            release_free_heap()
        else:
            statuses = self._statuses()
        pids = {}
        for worker_id in statuses:
            try:
                pids[worker_id] = self._describe(worker_id)["pid"]
            except Exception:  # the actor is gone (Ray gave up restarting it)
                pass
        peers = Peers({os.getpid(): "router", self.cluster.redis_server.pid or 0: "redis",
                       **{pid: worker_id for worker_id, pid in pids.items()}})
        sample = Sample(label, *process_usage(os.getpid(), peers), self.cluster.redis_server.pid)
        for worker_id, status in statuses.items():
            try:
                pid = pids[worker_id]
                w_rss, w_fds, w_kinds = process_usage(pid, peers)
            except Exception:  # the actor is gone (Ray gave up restarting it): record what Status said
                pid, w_rss, w_fds, w_kinds = 0, 0, 0, {}
            sample.workers[worker_id] = {"pid": pid, "rss": w_rss, "fds": w_fds, "fd_kinds": w_kinds,
                                         "used_blocks": status.used_blocks,
                                         "free_blocks": status.free_blocks, "num_blocks": status.num_blocks,
                                         "epoch": status.epoch}
        self.samples.append(sample)
        return sample

    def _wait_settled(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            statuses = self._statuses()
            settled = (len(statuses) == len(self.cluster.actors)
                       and all(s.used_blocks == 0 for s in statuses.values()))
            if settled or time.monotonic() > deadline:
                return statuses
            time.sleep(1.0)

    def touch_every_pair(self) -> None:
        """Send one short round-robin request per (prefill, decode) pair, so that every KV channel
        the soak can use is open when an idle sample is taken: a prefill worker opens its channel
        to a decode worker on its first transfer there, and which pairs the load happened to use
        would otherwise show as descriptor drift. Round robin turns the prefill and the decode
        choice once per remote request, so P x D requests in a row visit every pair when P and D
        are coprime (2 and 3 here)."""
        import grpc

        from loadtest.workloads import TOKEN_ID_RANGE
        from pdserve.client import PdserveClient

        spec, rng = self.cluster.spec, random.Random(len(self.samples))
        with PdserveClient(self.router, timeout_s=120) as client:
            for _ in range(spec.num_prefill * spec.num_decode):
                prompt = [rng.randrange(*TOKEN_ID_RANGE) for _ in range(64)]  # >= 32: prefilled remotely
                try:
                    client.generate(token_ids=prompt, max_tokens=2, temperature=0, routing="round_robin")
                except grpc.RpcError as e:  # a worker not back yet: this pair stays as it is
                    print(f"[soak] touch_every_pair: {e.code().name}: {e.details()}", flush=True)

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
    def load_command(self, name: str, arrival: list[str], duration_s: float, requests: int) -> list[str]:
        """`python -m loadtest` sending the soak's synthetic workload; its report goes to OUT/name."""
        return [sys.executable, "-m", "loadtest", "--router", self.router, "--workload", "synthetic",
                "-p", f"input_tokens={self.args.input_tokens}",
                "-p", f"output_tokens={self.args.output_tokens}", "-p", "range_ratio=0.5",
                *arrival, "--duration", str(duration_s), "--requests", str(requests),
                "--seed", str(len(self.samples)), "--timeout", "120", "--label", name,
                "--out", os.path.join(self.args.out, name)]

    def run_load(self, command: list[str]) -> subprocess.Popen:
        self.load_proc = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.DEVNULL)
        return self.load_proc

    def load_report(self, name: str, proc: subprocess.Popen) -> dict[str, Any]:
        if proc.wait() != 0:
            raise RuntimeError(f"the {name} load run exited with code {proc.returncode}; its "
                               "error is printed above")
        with open(os.path.join(self.args.out, name, "report.json"), encoding="utf-8") as f:
            return json.load(f)

    def run(self) -> dict[str, Any]:
        self.router = self.cluster.start()
        closed_loop = ["--concurrency", str(self.args.capacity_concurrency)]
        capacity_cmd = self.load_command("capacity", closed_loop, self.args.capacity_s, 10_000)
        capacity = self.load_report("capacity", self.run_load(capacity_cmd))
        rate = max(0.05, self.args.load * (capacity["requests_per_s"] or 0.0))
        warmup = self.faulted_load("warmup", rate, range(-self.args.warmup_minutes, 0))
        baseline = self.sample("baseline", idle=True)
        traced = tracemalloc.take_snapshot() if tracemalloc.is_tracing() else None
        report = self.faulted_load("soak", rate, range(self.args.minutes))
        final = self.sample("final", idle=True)
        if traced is not None:
            out = os.path.join(self.args.out, "tracemalloc.txt")
            write_memory_growth(traced, tracemalloc.take_snapshot(), out)
        return self.summary(capacity, rate, report, baseline, final, warmup)

    def faulted_load(self, name: str, rate: float, minutes: range) -> dict[str, Any] | None:
        """Poisson arrivals at rate for len(minutes) minutes from a `python -m loadtest` process
        (its report in OUT/name), a fault injected 5 s into each minute and a sample taken near its
        end; None when there are no minutes. The fault cycle runs on from the warm-up's negative
        minutes into the soak's: the cycle is indexed by minute, so a warm-up of one minute per
        fault has injected each of them once before the baseline."""
        if not minutes:
            return None
        duration_s = len(minutes) * 60.0
        expected = int(rate * duration_s * 2) + 10  # a bound only: the duration ends the run
        load = self.run_load(self.load_command(name, ["--rate", f"{rate:.4f}"], duration_s, expected))
        started = time.monotonic()
        for i, minute in enumerate(minutes):
            _sleep_until(started + i * 60.0 + 5.0)
            self.inject(minute)
            _sleep_until(started + i * 60.0 + 55.0)
            self.sample(f"{name} minute {minute}", idle=False)
        return self.load_report(name, load)

    def summary(self, capacity, rate, report, baseline: Sample, final: Sample,
                warmup: dict[str, Any] | None = None) -> dict[str, Any]:
        drift: dict[str, dict[str, Any]] = {"router": {
            "rss": _drift(baseline.router_rss, final.router_rss),
            "fds": _drift(baseline.router_fds, final.router_fds), "restarted": False}}
        for worker_id, before in baseline.workers.items():
            after = final.workers.get(worker_id, {})
            drift[worker_id] = {key: _drift(before[key], after.get(key))
                                for key in ("rss", "fds", "free_blocks")}
            drift[worker_id]["restarted"] = after.get("pid") != before["pid"]
        leaked = {w: v["used_blocks"] for w, v in final.workers.items() if v["used_blocks"]}
        judged = {name: d for name, d in drift.items() if not d["restarted"]}
        pools_whole = all(d["free_blocks"] == 0 for name, d in drift.items() if name != "router")
        within = all(d[k] is not None and abs(d[k]) < 0.01 for d in judged.values() for k in ("rss", "fds"))
        target_met = not leaked and len(final.workers) == len(baseline.workers) and pools_whole and within
        return {"capacity_requests_per_s": capacity["requests_per_s"], "soak_rate": rate,
                "minutes": self.args.minutes, "faults": self.faults,
                "warmup": {"counts": warmup["counts"], "errors": warmup["errors"]} if warmup else None,
                "counts": report["counts"], "errors": report["errors"],
                "errors_by_fault": self.errors_by_fault(report),
                "ttft_ms": report["ttft_ms"], "itl_ms": report["itl_ms"],
                "drift": drift, "judged": sorted(judged), "drift_target_met": target_met,
                "blocks_in_use_at_end": leaked, "workers_back": sorted(final.workers),
                "samples": [vars(s) for s in self.samples]}

    def errors_by_fault(self, report: dict[str, Any]) -> dict[str, Any]:
        """Each failed request, attributed to the last fault injected before it ended; with the
        longest time from that injection to a failure, per fault. A warm-up fault's minute is
        negative: a soak request that failed before the soak's first fault is attributed to the
        warm-up's last one."""
        started = report["started_unix_s"]  # send_s and end_s count from this instant
        out: dict[str, Any] = {}
        with open(os.path.join(self.args.out, "soak", "requests.jsonl"), encoding="utf-8") as f:
            failed = [r for r in map(json.loads, f) if r["status"] != "OK"]
        for record in failed:
            ended = started + record["end_s"]
            fault = max((x for x in self.faults if x["at"] <= ended), key=lambda x: x["at"], default=None)
            key = f"minute {fault['minute']} {fault['fault']}" if fault else "before any fault"
            entry = out.setdefault(key, {"count": 0, "statuses": {}, "latest_s_after_fault": 0.0})
            entry["count"] += 1
            entry["statuses"][record["status"]] = entry["statuses"].get(record["status"], 0) + 1
            if fault:
                latest = max(entry["latest_s_after_fault"], ended - fault["at"])
                entry["latest_s_after_fault"] = round(latest, 1)
        return out

    def stop(self) -> None:
        if self.load_proc is not None and self.load_proc.poll() is None:
            self.load_proc.kill()  # interrupted: the client goes first
            self.load_proc.wait()
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
    if args.trace_memory:
        tracemalloc.start(10)
    soak = Soak(args)
    try:
        summary = soak.run()
    finally:
        soak.stop()
    with open(os.path.join(args.out, "soak.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
    print(json.dumps({k: summary[k] for k in ("capacity_requests_per_s", "soak_rate", "counts", "errors",
                                             "errors_by_fault", "drift", "drift_target_met",
                                             "blocks_in_use_at_end")}, indent=2))
    return 0 if summary["drift_target_met"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
