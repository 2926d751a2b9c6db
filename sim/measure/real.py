"""The real cluster the simulator is checked against and calibrated on: `pdserve up`'s LocalCluster
(deploy/launcher.py) in one of the simulator's topologies, driven by `pdserve loadtest`'s runner.

    real_cluster(topology)       a started cluster (each worker warmed by one request); stopped on exit
    run_load(router, load)       one load-test run through the router: its report and records
    step_totals(cluster)         every worker's steps with work and their wall time so far
    traced_steps(cluster, after) every worker's traced steps since `after` (Worker.Steps): TracedStep

bench/sim_validate.py compares the simulator with these runs; `pdserve sim calibrate --in-cluster`
(sim/measure/calibrate_cluster.py) fits the step costs to the steps they trace. Not pure: it starts Ray,
Redis and the workers, so it is imported only where a command needs it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from pdserve.engine.scheduler import StepShape

TOPOLOGIES = {"1P+1D": (1, 1), "2 colocated": (0, 2)}  # (prefill workers, decode workers)


@dataclass(frozen=True)
class Load:
    """One load-test run: a named workload (loadtest/workloads.py) with its parameters, Poisson
    arrivals at `rate` requests/s, `requests` requests drawn from `seed`."""

    workload: str
    params: dict[str, Any]
    rate: float
    requests: int
    seed: int


@dataclass(frozen=True)
class TracedStep:
    """One step a real worker ran (Worker.Steps): what it computed, its wall time, the worker's own
    time since the step before it (None: the worker waited for work in between), which worker ran
    it, and when it started (time.perf_counter() in that worker: one clock for the whole machine)."""

    shape: StepShape
    seconds: float
    gap_s: float | None
    worker: str = ""
    started_at: float = 0.0


@contextlib.contextmanager
def real_cluster(topology: str, say: Callable[[str], None]) -> Iterator[tuple[Any, str]]:
    """(the LocalCluster, its router's address), every worker warmed by one request."""
    from deploy.config import ClusterSpec

    num_prefill, num_decode = TOPOLOGIES[topology]
    spec = ClusterSpec(num_prefill=num_prefill, num_decode=num_decode, port=0, http_port=0, metrics_port=None,
                       namespace=f"sim-{num_prefill}p{num_decode}d")
    with warmed_cluster(spec, say=lambda line: say(f"{topology}: {line}")) as started:
        yield started


@contextlib.contextmanager
def warmed_cluster(spec: Any, say: Callable[[str], None],
                   warm_tokens: int = 100) -> Iterator[tuple[Any, str]]:
    """`pdserve up`'s LocalCluster of `spec`, started: (the cluster, its router's address) once as many
    greedy requests of `warm_tokens` tokens as it has workers have run (each worker's kernels warmed
    once, as the router spreads them); stopped on the way out."""
    from deploy.launcher import LocalCluster
    from pdserve.client import PdserveClient

    cluster = LocalCluster(spec, say=say)
    try:
        router = cluster.start()
        with PdserveClient(router, timeout_s=600) as client:
            for _ in range(spec.num_prefill + spec.num_decode):
                client.generate(token_ids=list(range(1000, 1000 + warm_tokens)), temperature=0, max_tokens=4)
        yield cluster, router
    finally:
        cluster.stop()


def run_load(router: str, load: Load, label: str = "") -> Any:
    """One load-test run (greedy, ignore_eos: every request's length is exact): its RunResult, the
    report and each request's record."""
    from loadtest.arrivals import Bounds, Poisson
    from loadtest.runner import LoadTestConfig, RequestOptions, run_loadtest_async
    from loadtest.workloads import make_workload

    config = LoadTestConfig(
        router=router,
        workload=make_workload(load.workload, load.params),
        arrivals=Poisson(load.rate),
        bounds=Bounds(load.requests, 900.0),
        seed=load.seed,
        options=RequestOptions(temperature=0.0, ignore_eos=True, timeout_s=600),
        progress=False,
        label=label,
    )
    return asyncio.run(run_loadtest_async(config))


def _statuses(cluster) -> list:
    import ray

    from protos.pdserve.v1 import worker_pb2

    replies = ray.get([actor.status.remote() for actor in cluster.actors.values()], timeout=60)
    return [worker_pb2.WorkerStatus.FromString(r) for r in replies]


def step_totals(cluster) -> tuple[int, float]:
    """The workers' steps with work and their wall time so far, summed (WorkerStatus totals)."""
    statuses = _statuses(cluster)
    return sum(s.steps_total for s in statuses), sum(s.step_seconds_total for s in statuses)


def worker_blocks(cluster) -> int:
    """KV blocks of the smallest worker pool (WorkerStatus.num_blocks)."""
    return min(s.num_blocks for s in _statuses(cluster))


def traced_steps(cluster, after: dict[str, int]) -> tuple[list[TracedStep], dict[str, int]]:
    """Every worker's traced steps numbered above after[its name] (0 when absent); and each worker's
    step count, the `after` of the next call."""
    import ray

    from protos.pdserve.v1 import worker_pb2

    names = list(cluster.actors)
    replies = ray.get([cluster.actors[n].steps.remote(after.get(n, 0)) for n in names], timeout=60)
    steps, totals = [], {}
    for name, raw in zip(names, replies):
        reply = worker_pb2.StepsReply.FromString(raw)
        totals[name] = reply.steps_total
        steps += [TracedStep(shape_of(r), r.seconds, r.gap_seconds if r.HasField("gap_seconds") else None,
                             name, r.started_at)
                  for r in reply.steps]
    return steps, totals


def shape_of(record) -> StepShape:
    """A worker_pb2.StepRecord as the engine's StepShape."""
    return StepShape(tuple(zip(record.prefill_tokens, record.prefill_start)), record.decode_seqs,
                     record.decode_context)
