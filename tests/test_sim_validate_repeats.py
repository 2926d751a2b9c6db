"""bench.sim_validate's summary of repeated real runs, and its table: hand-computed cases (no cluster)."""

from bench.sim_validate import real_steps_entry, steps_entry, summarize_repeats, table


def rows(*cells: tuple[float, float, bool]) -> list[dict]:
    """One topology row per cell tuple: (real, sim, within)."""
    return [{"metrics": {"ttft_p50_ms": {"real": r, "sim": s, "within": w}}} for r, s, w in cells]


def test_repeats_report_each_reps_count_the_real_runs_own_agreement_and_the_sim_against_their_mean():
    # cell A: real 100 then 130 (each 30% / 23% off the other), sim 115 (within 20% of the mean 115)
    # cell B: real 200 then 210 (within 5%), sim 300 (50% over the mean 205)
    rep1 = rows((100, 115, True), (200, 300, False))
    rep2 = rows((130, 115, True), (210, 300, False))
    out = summarize_repeats([rep1, rep2], tolerance=0.2)
    assert out == {"reps": 2, "within_per_rep": [1, 1], "real_self_within": 0.5,
                   "sim_vs_real_mean_within": 1, "cells": 2}


def test_a_cell_without_a_value_in_some_rep_is_left_out():
    reps = [rows((None, 1.0, False), (10, 10, True)), rows((5, 1.0, False), (10, 10, True))]
    out = summarize_repeats(reps, 0.2)
    assert out["cells"] == 1 and out["real_self_within"] == 1.0 and out["sim_vs_real_mean_within"] == 1


def test_the_table_gives_each_runs_mean_step_real_over_simulated_and_a_dash_for_older_results():
    run = {"topology": "2 colocated", "workload": "synthetic", "rate": 0.5, "load_average_1m": 1.0,
           "metrics": {"ttft_p50_ms": {"real": 120.0, "sim": 100.0, "within": True}}}
    steps = {"real": steps_entry(10, 1.26), "sim": steps_entry(12, 0.864)}
    assert steps["real"] == {"steps": 10, "busy_s": 1.26, "step_ms_mean": 126.0}
    result = {"runs": [{**run, "steps": steps}, run], "within": 2, "cells": 2, "tolerance": 0.2}
    lines = table(result).splitlines()
    assert lines[1].endswith(" 126/72") and lines[2].endswith(" -")
    assert steps_entry(0, 0.0)["step_ms_mean"] is None


def test_rescore_simulates_a_saved_runs_cells_again_against_their_real_values(tmp_path):
    """--rescore: a run whose real values are what one cost file simulates scores every cell within
    under that file, and misses its latencies under a file whose steps take twice as long."""
    from dataclasses import replace

    from bench.sim_validate import METRICS, TOPOLOGIES, WORKLOADS, cell, metric, rescore, simulate_like
    from sim.costs import save_costs
    from tests.sim.test_mechanisms import make_costs

    base, slow = make_costs(num_blocks=512), tmp_path / "slow.json"
    save_costs(base, tmp_path / "base.json")
    step = base.step
    doubled = replace(step, base_s=2 * step.base_s, prefill_token_s=2 * step.prefill_token_s,
                      decode_seq_s=2 * step.decode_seq_s)
    save_costs(replace(base, step=doubled), slow)
    report, _ = simulate_like("synthetic", WORKLOADS["synthetic"], 4, 0.5, 11, TOPOLOGIES["2 colocated"],
                              str(tmp_path / "base.json"))
    row = {"topology": "2 colocated", "workload": "synthetic", "rate": 0.5, "seed": 11,
           "load_average_1m": 1.0, "steps": None,
           "metrics": {m: cell(metric(report, m), None, 0.2) for m in METRICS}}
    saved = {"requests_per_run": 4, "costs": "base.json", "runs": [row]}
    same = rescore(saved, str(tmp_path / "base.json"), 0.2)
    assert (same["within"], same["cells"]) == (6, 6)
    slower = rescore(saved, str(slow), 0.2)["runs"][0]["metrics"]
    assert not slower["ttft_p50_ms"]["within"] and not slower["itl_p50_ms"]["within"]
    assert slower["prefix_hit_rate"]["within"]  # the cache does not care how long a step takes


def test_the_real_steps_are_priced_by_the_cost_files_formula_and_their_gaps_summed(tmp_path):
    """A run's traced steps against sim/costs.py's formula: 10 ms + 1 ms a prefill token + 1 ms a
    decoding sequence (tests/sim/test_mechanisms.py's costs)."""
    from sim.costs import save_costs
    from tests.sim.test_mechanisms import make_costs

    save_costs(make_costs(), tmp_path / "c.json")
    # an 8-token prefill (18 ms by the formula) took 27 ms; two decode rows (12 ms) took 15 ms, 0.1 ms
    # after the step before; a result written before gaps were traced has 4 fields a step
    trace = [[[[8, 0]], 0, 0, 0.027, None], [[], 2, 40, 0.015, 0.0001], [[], 2, 42, 0.012]]
    entry = real_steps_entry(trace, str(tmp_path / "c.json"))
    assert (entry["steps"], entry["busy_s"], entry["formula_s"]) == (3, 0.05, 0.04)  # rounded to 10 ms
    assert entry["busy_over_formula"] == round(0.054 / 0.042, 3) and entry["gap_s"] == 0.0001
    assert real_steps_entry(trace[2:], str(tmp_path / "c.json"))["gap_s"] is None


def test_a_repeated_validation_keeps_every_reps_rows_not_only_the_firsts():
    from bench.sim_validate import assemble

    rep1, rep2 = rows((100, 115, True), (200, 300, False)), rows((130, 115, True), (210, 300, False))
    out = assemble([rep1, rep2], tolerance=0.2, requests=40, costs="c.json")
    assert (out["runs"], out["later_reps"], out["within"], out["cells"]) == (rep1, [rep2], 1, 2)
    assert out["repeats"]["within_per_rep"] == [1, 1]
    single = assemble([rep1], 0.2, 40, "c.json")
    assert "later_reps" not in single and "repeats" not in single
