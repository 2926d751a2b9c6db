"""`pdserve sim calibrate --in-cluster`: fit the step costs to the steps a running cluster takes.

The engine-alone calibration (sim/measure/calibrate.py) times LLMEngine.step in a process of its own. In a
running cluster the same steps took 5-30% longer, more under load (docs/simulator.md, validation
of 2026-12-06): each worker's gRPC threads stream tokens and KV frames beside its engine thread, and
the router, the load tester, Ray and Redis share the cores. Those costs are what the simulator has to
predict, and only a running cluster has them. So this calibration:

    1. starts the real cluster (sim/measure/real.py) in each of `topologies`: 1 prefill + 1 decode, and
       2 colocated (the two shapes bench.sim_validate checks);
    2. sends CALIBRATION_LOADS through its router: shapes that span the cost model's terms (short
       prompts at a rate that batches decode rows, long prompts one at a time, prompts behind a
       cached system prompt, a multi-turn chat), with seeds and sizes other than the validation's,
       so the validation stays a test of the model, not of its fit;
    3. reads every step each worker ran from its step trace (Worker.Steps: what the step computed
       and its wall time) and fits sim/costs.py's formula to them (sim/measure/calibrate.py
       fit_step_costs), spread included.

Two workers' contention is inside those times, so shared_machine_slowdown is 0 (it would count it
twice). The same runs give each request's time outside the workers: its TTFT at the client less
the prefill and transfer time the router's timings report; the median is the file's
request.overhead_s (sim/costs.py). Transfer costs are measured as sim/measure/calibrate.py measures them;
blocks per worker are the workers' own (WorkerStatus.num_blocks).
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from sim.costs import CostModel, Hardware, RequestCosts
from sim.measure.calibrate import SAMPLE_COLUMNS, features, fit_step_costs, measure_transfer
from sim.measure.real import TOPOLOGIES, Load, TracedStep

CALIBRATION_LOADS = (
    Load("synthetic", {"input_tokens": 48, "output_tokens": 32}, rate=3.0, requests=24, seed=101),
    Load("synthetic", {"input_tokens": 480, "output_tokens": 8}, rate=0.3, requests=6, seed=102),
    # a few long prompts: without them the curve's 1,024-row knot rests on steps of 400-600 rows
    Load("synthetic", {"input_tokens": 960, "output_tokens": 4}, rate=0.25, requests=3, seed=105),
    Load("shared-prefix", {"system_prompt_tokens": 384, "question_tokens": 40, "output_tokens": 16},
         rate=1.0, requests=12, seed=103),
    Load("multi-turn", {"turns": 2, "turn_tokens": 64, "output_tokens": 16}, rate=1.0, requests=8, seed=104),
)


@dataclass
class _Traced:
    """What the calibration loads left: each step's features and time, each request's time outside
    the workers, steps per topology, and each topology's smallest worker pool."""

    rows: list[list[float]] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    overheads: list[float] = field(default_factory=list)
    per_topology: dict[str, int] = field(default_factory=dict)
    blocks: list[int] = field(default_factory=list)


def calibrate_in_cluster(threads: int, topologies: tuple[str, ...] = tuple(TOPOLOGIES),
                         loads: tuple[Load, ...] = CALIBRATION_LOADS,
                         say: Callable[[str], None] = lambda _: None) -> CostModel:
    """`threads`: the torch threads each worker gets (recorded; `pdserve up` gives each of two
    workers half the cores, which is what the cluster started here does)."""
    traced = _Traced()
    for topology in topologies:
        steps, outside, blocks = _trace_topology(topology, loads, say)
        traced.per_topology[topology] = len(steps)
        traced.blocks.append(blocks)
        traced.rows += [features(step.shape) for step in steps]
        traced.times += [step.seconds for step in steps]
        traced.overheads += outside
    if not traced.rows:
        raise RuntimeError("the calibration loads ran no engine step on any worker")
    step, relative = fit_step_costs(traced.rows, traced.times)
    say("KV transfer (gRPC)")
    transfer = measure_transfer(progress=False)
    overhead = max(0.0, float(np.median(traced.overheads))) if traced.overheads else 0.0
    return CostModel(step, transfer, _hardware(min(traced.blocks)), _source(threads, loads, traced, relative),
                     RequestCosts(overhead))


def _hardware(num_blocks: int) -> Hardware:
    from pdserve.engine.config import EngineConfig, SchedulerConfig
    from pdserve.engine.weights import load_model

    # NOTE: the CPU workers' cache, kv_dtype resolved as their engines resolve it (auto: float32)
    config, cache, batching = load_model(progress=False).config, EngineConfig().resolved("cpu")[0].cache, \
        SchedulerConfig()
    return Hardware(config.kv_bytes_per_token(cache.kv_dtype), config.num_layers, num_blocks,
                    cache.block_size, batching.max_num_batched_tokens, batching.max_num_seqs,
                    workers_per_machine=2)


def _source(threads: int, loads: tuple[Load, ...], traced: _Traced, relative: np.ndarray) -> dict[str, Any]:
    overheads = traced.overheads
    return {
        "note": "measured on this machine by `pdserve sim calibrate --in-cluster`: the steps of a running "
                "cluster's workers under the calibration loads (sim/measure/calibrate_cluster.py)",
        "calibrated_in": "cluster",
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "torch_threads": threads,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "topologies": traced.per_topology,
        "loads": [asdict(load) for load in loads],
        "steps": len(traced.rows),
        "fit_relative_error_median": round(float(np.median(relative)), 3),
        "fit_relative_error_p90": round(float(np.percentile(relative, 90)), 3),
        "samples": {"columns": list(SAMPLE_COLUMNS), "rows": traced.rows, "step_s": traced.times},
        "load_average": list(os.getloadavg()),
        "shared_machine": "in the traced steps (two workers on this machine): shared_machine_slowdown 0",
        "request_overhead_s": {"requests": len(overheads),
                               "median": float(np.median(overheads)) if overheads else None,
                               "p10_p90": [float(np.percentile(overheads, q)) for q in (10, 90)]
                               if overheads else None},
    }


def outside_the_workers(record) -> float | None:
    """Seconds of a request's TTFT the workers did not report as theirs (RequestCosts): the client's
    TTFT less the prefill and transfer time in the router's timings (None without them)."""
    timings = record.server_timings_ms
    if not record.ok or not record.token_times_s or not timings:
        return None
    return record.ttft_ms / 1e3 - (timings.get("prefill_ms", 0.0) + timings.get("transfer_ms", 0.0)) / 1e3


def _trace_topology(topology: str, loads: tuple[Load, ...],
                    say: Callable[[str], None]) -> tuple[list[TracedStep], list[float], int]:
    """Every step the workers of a fresh `topology` cluster ran under `loads` (not the warm-up's),
    each request's time outside the workers (outside_the_workers), and the blocks of its smallest
    worker pool."""
    from sim.measure.real import real_cluster, run_load, traced_steps, worker_blocks

    with real_cluster(topology, say) as (cluster, router):
        _, after = traced_steps(cluster, {})  # the warm-up's steps pay for torch's lazy set-up: skip them
        steps, outside = [], []
        for load in loads:
            say(f"{topology}: {load.workload} at {load.rate}/s, {load.requests} requests")
            records = run_load(router, load, label=f"calibrate {topology}").records
            outside += [s for s in map(outside_the_workers, records) if s is not None]
            new, after = traced_steps(cluster, after)
            steps += new
        return steps, outside, worker_blocks(cluster)
