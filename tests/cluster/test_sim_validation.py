"""A short validation of the simulator against the real cluster (docs/simulator.md).

One workload (shared-prefix: its prefix hits are the mechanism most worth checking), 2 colocated
workers, light and heavier load, 8 requests each: bench.sim_validate, the script behind the full
table, run small. The tolerance is looser than the issue's 20% target, and stated here: on a
2-core machine shared with other work, 8-request percentiles swing by tens of percent between two
runs of the real cluster alone, so the test asks for the mechanisms to be right, not the noise:

    prefix hit rate                      within 35%   (set by caching and routing, not noise)
    throughput at the light rate         within 35%   (set by the arrivals)
    throughput at the heavier rate       within a factor of 2 (|sim - real| / real <= 1.0)
    TTFT p50 and ITL p50                 within a factor of 2.5 (|sim - real| / real <= 1.5)

At the heavier rate the workers are near saturation, so throughput is set by the step time under
overlap, which the simulator underestimates (docs/simulator.md, "The target is not met") and
which moves with the machine: two back-to-back runs here (2026-12-03 18:07, the checked-in costs)
measured 19.4 and 24.5 tokens/s against the simulator's 27.2 (errors 0.40 and 0.11), and a CI run
14.6 against 22.8 (0.56).

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

# |sim - real| / real allowed, by rate (requests/s): the light one, then the heavier one
TIGHT = {0.5: {"prefix_hit_rate": 0.35, "throughput_tokens_per_s": 0.35},
         1.5: {"prefix_hit_rate": 0.35, "throughput_tokens_per_s": 1.0}}
LOOSE = ("ttft_p50_ms", "itl_p50_ms")  # within --tolerance 1.5


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
    assert [run["rate"] for run in result["runs"]] == list(TIGHT)
    for run in result["runs"]:
        m = run["metrics"]
        for name, tolerance in TIGHT[run["rate"]].items():
            error = m[name]["rel_error"]
            assert error is not None and error <= tolerance, (run["rate"], name, m[name])
        for name in LOOSE:
            assert m[name]["within"], (run["rate"], name, m[name])
