"""A short validation of the simulator against the real cluster (docs/simulator.md).

One workload (shared-prefix: its prefix hits are the mechanism most worth checking), 2 colocated
workers, light and heavier load, 8 requests each: bench.sim_validate, the script behind the full
table, run small. The tolerance is looser than the issue's 20% target, and stated here: on a
2-core machine shared with other work, 8-request percentiles swing by tens of percent between two
runs of the real cluster alone, so the test asks for the mechanisms to be right, not the noise:

    throughput and prefix hit rate       within 35%   (set by arrivals and caching, not noise)
    TTFT p50 and ITL p50                 within a factor of 2.5 (|sim - real| / real <= 1.5)

The costs are calibrated first, here (`pdserve sim calibrate --quick`, about 50 s), at the torch
threads the real workers get: the machine's CPU can change between sessions, and a cost file from
another CPU or thread count is off by more than any tolerance (a 2-thread file against 1-thread
workers once put the simulated ITL at a third of the real one).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from bench.sim_validate import parse_args, validate
from pdserve.engine.config import cpu_threads_per_worker

TIGHT = ("throughput_tokens_per_s", "prefix_hit_rate")
LOOSE = ("ttft_p50_ms", "itl_p50_ms")


def test_a_cost_file_of_another_thread_count_is_refused_with_the_command_to_fix_it(tmp_path):
    from dataclasses import replace

    from sim.costs import load_costs, save_costs
    threads = cpu_threads_per_worker(2)
    here = load_costs("sim/data/this_machine.json")
    costs = tmp_path / "costs.json"
    save_costs(replace(here, source={**here.source, "torch_threads": threads + 1}), costs)
    with pytest.raises(SystemExit, match=f"calibrated at {threads + 1} torch threads.*Recalibrate: "
                                         f"`pdserve sim calibrate --threads {threads} "):
        validate(parse_args(["--costs", str(costs)]))


def test_the_simulator_tracks_the_real_cluster_on_shared_prefix(ray_session, tmp_path):
    costs = tmp_path / "this_machine.json"
    subprocess.run([sys.executable, "-m", "deploy.cli", "sim", "calibrate", "--quick", "--no-progress",
                    "--threads", str(cpu_threads_per_worker(2)), "--out", str(costs)],
                   check=True, capture_output=True)
    args = parse_args(["--costs", str(costs), "--requests", "8", "--workloads", "shared-prefix",
                       "--topologies", "2 colocated",
                       "--light-rate", "0.5", "--heavy-rate", "1.5", "--tolerance", "1.5"])
    result = validate(args)
    assert len(result["runs"]) == 2
    for run in result["runs"]:
        m = run["metrics"]
        for name in TIGHT:
            error = m[name]["rel_error"]
            assert error is not None and error <= 0.35, (run["rate"], name, m[name])
        for name in LOOSE:
            assert m[name]["within"], (run["rate"], name, m[name])
