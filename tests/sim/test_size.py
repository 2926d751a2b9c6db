"""Sizing: splits x policies, the SLO parser, `pdserve sim size --json` and the DistServe shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deploy.cli import main
from loadtest.workloads import make_workload
from sim.costs import load_costs
from sim.size import SizingSLO, shapes, size
from sim.workload import from_workload

GPU_COSTS = str(Path(__file__).resolve().parents[2] / "sim" / "data" / "h100_llama8b.json")


def test_the_slo_takes_either_objective_and_names_a_bad_one():
    assert SizingSLO.parse("itl_p99_ms=50") == SizingSLO(2000.0, 50.0)
    with pytest.raises(ValueError, match="ttft_p90_ms=MS"):
        SizingSLO.parse("ttft_p50_ms=10")


def test_the_candidates_are_colocated_and_every_split_under_every_policy():
    labels = [(s.label, s.routing) for s in shapes(3, ("prefix", "least_load"))]
    assert labels == [("colocated x3", "prefix"), ("colocated x3", "least_load"), ("1P:2D", "prefix"),
                      ("1P:2D", "least_load"), ("2P:1D", "prefix"), ("2P:1D", "least_load")]


def test_size_json_names_the_best_split_and_policy_and_lists_every_candidate(capsys):
    rc = main(["sim", "size", "--workload", "synthetic", "-p", "input_tokens=512", "--requests", "40",
               "--rate", "20", "--gpus", "2", "--costs", GPU_COSTS, "--no-bisect", "--no-progress", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and len(out["candidates"]) == 6
    assert {"split", "prefill", "decode", "policy", "goodput_rps"} <= set(out["best"])
    assert out["best"]["goodput_rps"] == max(c["goodput_rps"] for c in out["candidates"])


def _sized(itl_ms: float, rate: float) -> dict:
    workload = make_workload("synthetic", {"input_tokens": 1024, "output_tokens": 64})
    return size(lambda r: from_workload(workload, 150, r, 0), rate, 2, load_costs(GPU_COSTS),
                SizingSLO(1000.0, itl_ms), policies=("least_load",), bisect=False)


def test_with_gpu_costs_disaggregation_wins_under_a_tight_itl_slo_and_colocated_under_a_loose_one():
    # a 1024-token prefill in a colocated step (~50 ms) breaks a 25 ms ITL; on its own worker it cannot
    tight = _sized(25.0, 12.0)
    assert not tight["best"]["colocated"]
    # the crossover: with a loose ITL objective and a rate one prefill worker cannot keep up with
    # (~21 prompts/s of 1024 tokens), two colocated workers, both prefilling, win
    loose = _sized(1000.0, 32.0)
    assert loose["best"]["colocated"]
    by_split = {c["split"]: c["goodput_rps"] for c in loose["candidates"]}
    assert by_split["colocated x2"] > 1.5 * by_split["1P:1D"]


def test_the_default_cost_file_is_found_from_any_working_directory(tmp_path, monkeypatch, capsys):
    """`pdserve sim run` without --costs reads the simulator's own sim/data/this_machine.json, which the
    wheel ships (tests/test_package_data.py), not a path relative to where it was started."""
    monkeypatch.chdir(tmp_path)
    rc = main(["sim", "run", "--workload", "synthetic", "--requests", "5", "--rate", "2", "--json"])
    assert rc == 0 and json.loads(capsys.readouterr().out)["counts"]["completed"] == 5
