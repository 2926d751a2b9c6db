"""The GPU check's dry run: `python -m bench.gpu_check --dry-run` runs every stage's code on tiny shapes on
the CPU (Triton interpreted), so the script a GPU machine's few minutes are spent on has run end to end
before it gets there.

One subprocess, as a user runs it (TRITON_INTERPRET must be set before triton loads, which this test
process may already have done). Its JSON must hold every stage, each ok; a part that cannot run on the
CPU (CUDA graph capture) says so in a note instead. Figures are not checked: on a CPU at tiny sizes
they mean nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from bench.gpu_check import LOG_FILE, RESULT_FILE, STAGE_NAMES

ROOT = Path(__file__).resolve().parents[1]
DRY_RUN_BUDGET_S = 120.0


def test_dry_run_runs_every_stage_ok(tmp_path):
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--dry-run", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=2 * DRY_RUN_BUDGET_S)
    elapsed = time.monotonic() - started
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads((tmp_path / RESULT_FILE).read_text())
    assert result["dry_run"] and result["device"] == "cpu"
    stages = {s["name"]: s for s in result["stages"]}
    assert list(stages) == list(STAGE_NAMES)
    failed = {name: s.get("error", s.get("reason", ""))[-1500:]
              for name, s in stages.items() if s["status"] != "ok"}
    assert not failed, failed
    assert elapsed < DRY_RUN_BUDGET_S, f"the dry run took {elapsed:.0f} s"

    assert stages["triton_kernels"]["interpreted"] and stages["triton_kernels"]["failed_cases"] == 0
    for engine in stages["exactness"]["engines"].values():
        assert engine["identical"] == len(engine["prompts"])
    for stage in ("decode", "llama_1b"):
        rows = {(r["variant"], r.get("batch")): r for r in stages[stage]["decode"]}
        graph = [r for (variant, _), r in rows.items() if variant == "graph"]
        assert graph and all(r["note"].startswith("not captured on cpu") for r in graph)
        assert all(r["tokens_per_s"] > 0 for r in rows.values())
    assert "stage llama_1b ok" in (tmp_path / LOG_FILE).read_text()
    push = stages["kv_push"]
    assert all((tmp_path / log).is_file() for log in push["worker_logs"])
    assert push["tokens_equal"] and push["used_transferred_kv"] and push["bytes_sent"] > 0
    assert all(push["phases"][k] > 0 for k in ("d2h_encode_gbps", "wire_gbps", "h2d_receive_gbps"))


def test_a_failed_stage_is_recorded_and_the_next_runs(tmp_path):
    """--device names no device torch knows: card fails with its traceback, prefill still runs (and
    fails the same way), and the JSON holds both."""
    done = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--dry-run", "--device", "nosuchdevice",
                           "--stages", "card,prefill", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=DRY_RUN_BUDGET_S)
    assert done.returncode == 0, done.stderr[-4000:]
    stages = json.loads((tmp_path / RESULT_FILE).read_text())["stages"]
    assert [s["name"] for s in stages] == ["card", "prefill"]
    assert all(s["status"] == "failed" and "Traceback" in s["error"] for s in stages)


def test_a_stage_past_its_timeout_ends_the_run_and_stays_running(tmp_path):
    """A hung stage must not eat the machine's minutes: the run ends, the JSON keeps the stages before
    it and names the one it hung in, and the log has the stacks."""
    done = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--dry-run", "--stages",
                           "card,triton_kernels", "--stage-timeout", "0.3", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=DRY_RUN_BUDGET_S)
    assert done.returncode != 0
    stages = json.loads((tmp_path / RESULT_FILE).read_text())["stages"]
    assert [(s["name"], s["status"]) for s in stages] == [("card", "ok"), ("triton_kernels", "running")]
    assert "most recent call first" in (tmp_path / LOG_FILE).read_text()
