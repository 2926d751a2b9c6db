"""bench.sim_diagnostics' CPU accounting (the cluster run itself is a benchmark, not a test)."""

from __future__ import annotations

import os
import subprocess
import sys

from bench.sim_diagnostics import _cpu_seconds, outside_summary, parse_args


def test_cpu_seconds_are_keyed_by_pid_and_group_the_workers_and_this_process():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        seconds = _cpu_seconds({child.pid})
    finally:
        child.kill()
        child.wait()
    assert ("workers", child.pid) in seconds
    assert ("this process (router, load tester)", os.getpid()) in seconds
    assert all(s >= 0 for s in seconds.values())


def test_the_cpu_run_takes_a_known_workload_and_defaults_to_the_heavier_rate():
    args = parse_args(["cpu"])
    assert (args.workload, args.rate, args.requests) == ("synthetic", 1.5, 16)
    assert parse_args(["cpu", "--workload", "multi-turn"]).workload == "multi-turn"


def test_the_outside_run_defaults_to_the_validations_1p1d_shared_prefix_at_its_two_rates():
    args = parse_args(["outside"])
    assert (args.topology, args.workload, args.rates, args.requests) == \
        ("1P+1D", "shared-prefix", [0.5, 2.0], 40)
    assert parse_args(["outside", "--rates", "1,3.5", "--topology", "2 colocated"]).rates == [1.0, 3.5]


def test_time_outside_the_workers_is_summarized_in_milliseconds_like_a_loadtest_latency():
    # 0.005 .. 0.095 s in steps of 0.01: p50 halfway between 45 and 55 ms, p90 at 0.1 of the way
    # from 85 to 95 (numpy's linear rule over ten values), max 95
    out = outside_summary([0.005 + 0.01 * i for i in range(10)])
    assert (out["p50"], out["p90"], out["max"], out["count"]) == (50.0, 86.0, 95.0, 10)
    assert outside_summary([])["p50"] is None
