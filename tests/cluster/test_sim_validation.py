"""A short validation of the simulator against the real cluster (docs/simulator.md).

One workload (shared-prefix: its prefix hits are the mechanism most worth checking), 2 colocated
workers, light and heavier load, 8 requests each: bench.sim_validate, the script behind the full
table, run small. The tolerance is looser than the issue's 20% target, and stated here: on a
2-core machine shared with other work, 8-request percentiles swing by tens of percent between two
runs of the real cluster alone, so the test asks for the mechanisms to be right, not the noise:

    throughput and prefix hit rate       within 35%   (set by arrivals and caching, not noise)
    TTFT p50 and ITL p50                 within a factor of 2.5 (|sim - real| / real <= 1.5)
"""

from __future__ import annotations

from bench.sim_validate import parse_args, validate

TIGHT = ("throughput_tokens_per_s", "prefix_hit_rate")
LOOSE = ("ttft_p50_ms", "itl_p50_ms")


def test_the_simulator_tracks_the_real_cluster_on_shared_prefix(ray_session):
    args = parse_args(["--requests", "8", "--workloads", "shared-prefix", "--topologies", "2 colocated",
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
