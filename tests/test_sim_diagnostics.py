"""bench.sim_diagnostics' CPU accounting (the cluster run itself is a benchmark, not a test)."""

from __future__ import annotations

import os
import subprocess
import sys

from bench.sim_diagnostics import _cpu_seconds, parse_args


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
