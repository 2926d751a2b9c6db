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


def test_an_itl_p99_is_a_prefill_step_when_more_than_one_sample_in_a_hundred_falls_in_one():
    from bench.sim_diagnostics import step_tail
    from pdserve.engine.scheduler import StepShape

    decode, prefill = StepShape((), 2, 40), StepShape(((8, 0),), 2, 40)
    two_prompts = StepShape(((8, 0), (8, 0)), 0, 0)  # a step with no decoding sequence gives no ITL sample
    # 49 decode-only steps of 50 ms and one 500 ms step that also prefills, 2 sequences decoding in each:
    # 100 samples, 2 in the prefill step; the 99th sorted sample is a 500 ms one
    out = step_tail([(decode, 0.05)] * 49 + [(prefill, 0.5), (two_prompts, 0.6)])
    assert out == {"steps": 51, "steps_with_prefill": 2, "steps_prefilling_two_or_more": 1,
                   "itl_samples": 100, "share_of_itl_samples_in_prefill_steps": 0.02,
                   "itl_p99_from_steps_ms": 500.0}
    # one sample in 100 in the prefill step (and one more decode-only sample): the 99th is a decode step's
    one = StepShape((), 1, 20), StepShape(((8, 0),), 1, 20)
    out = step_tail([(decode, 0.05)] * 49 + [(one[0], 0.05), (one[1], 0.5)])
    assert (out["itl_samples"], out["share_of_itl_samples_in_prefill_steps"], out["itl_p99_from_steps_ms"]) \
        == (100, 0.01, 50.0)
    assert step_tail([])["itl_p99_from_steps_ms"] is None


def test_the_tail_command_needs_a_result_and_a_cell_and_at_least_one_draw(capsys):
    import pytest

    args = parse_args(["tail", "--result", "r.json", "--cell", "1P+1D multi-turn 2"])
    assert (args.result, args.cell, args.costs, args.draws) == ("r.json", "1P+1D multi-turn 2", None, 9)
    with pytest.raises(SystemExit):
        parse_args(["tail", "--result", "r.json", "--cell", "x", "--draws", "0"])
    assert "--draws must be >= 1" in capsys.readouterr().err


def test_the_tail_command_names_the_cells_form_when_the_result_has_no_such_cell(tmp_path):
    import json

    import pytest

    from bench.sim_diagnostics import tail

    result = tmp_path / "result.json"
    result.write_text(json.dumps({"runs": [{"topology": "1P+1D", "workload": "synthetic", "rate": 0.5}],
                                  "requests_per_run": 4, "costs": "sim/data/this_machine.json"}))
    with pytest.raises(SystemExit, match="has no cell '2 colocated synthetic 0.5'.*TOPOLOGY WORKLOAD RATE"):
        tail(parse_args(["tail", "--result", str(result), "--cell", "2 colocated synthetic 0.5"]))


def test_fit_recovers_the_step_costs_that_priced_a_results_real_steps_and_keeps_the_rest(tmp_path):
    import json

    from bench.sim_diagnostics import fit
    from sim.costs import load_costs

    base = load_costs("sim/data/this_machine.json")
    shapes = [((), seqs, 40 * seqs) for seqs in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)]
    shapes += [(((n, c),), seqs, 50 * seqs)
               for n in (40, 100, 300, 600, 1000) for c in (0, 200) for seqs in (0, 4)]
    trace = [[[list(c) for c in chunks], seqs, ctx, base.step_s(list(chunks), seqs, ctx), None]
             for chunks, seqs, ctx in shapes]
    rows = [{"steps": {"real": {"trace": trace[:20]}}}, {"steps": {"real": {"trace": trace[20:]}}}]
    result = tmp_path / "result.json"
    result.write_text(json.dumps({"runs": rows[:1], "later_reps": [rows[1:]], "requests_per_run": 4,
                                  "costs": "sim/data/this_machine.json"}))
    out = fit(parse_args(["fit", "--result", str(result), "--out", str(tmp_path / "fitted.json")]))
    assert out["steps"] == len(shapes) and out["fit_relative_error_p90"] < 1e-6
    fitted = load_costs(tmp_path / "fitted.json")
    for chunks, seqs, ctx in shapes:
        assert abs(fitted.step_s(list(chunks), seqs, ctx) / base.step_s(list(chunks), seqs, ctx) - 1) < 1e-6
    assert (fitted.transfer, fitted.hardware, fitted.request) == (base.transfer, base.hardware, base.request)
    assert "samples" not in fitted.source and "in-sample" in fitted.source["note"]


def test_a_steps_overlap_share_is_the_time_another_worker_was_stepping_too():
    from bench.sim_diagnostics import overlap_shares, overlap_summary

    steps = [("a", 0.0, 1.0), ("a", 1.0, 1.0),  # a: [0, 1], [1, 2]
             ("b", 0.5, 1.0),                   # b: [0.5, 1.5]: half of each of a's steps, all of its own
             ("c", 1.75, 1.0)]                  # c: [1.75, 2.75]: a's last quarter second (b is done by then)
    assert overlap_shares(steps) == [0.5, 0.75, 1.0, 0.25]
    alone = [("a", 0.0, 1.0), ("a", 1.0, 1.0)]
    assert overlap_shares(alone) == [0.0, 0.0]  # its own steps do not count
    summary = overlap_summary([0.0, 0.5, 0.75, 1.0], [1.0, 1.1, 1.2, 1.3])
    assert summary["by_share"] == {"0-0.05": {"steps": 1, "median_ratio": 1.0},
                                   "0.05-0.5": {"steps": 0, "median_ratio": None},
                                   "0.5-0.95": {"steps": 2, "median_ratio": 1.15},
                                   "0.95-1": {"steps": 1, "median_ratio": 1.3}}
    assert (summary["steps"], summary["mean_share"]) == (4, 0.562)


def test_fit_with_a_slowdown_takes_the_other_workers_overlap_out_of_the_prices(tmp_path):
    import json

    from bench.sim_diagnostics import fit
    from sim.costs import load_costs

    base = load_costs("sim/data/this_machine.json")
    shapes = [((), seqs, 40 * seqs) for seqs in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)]
    shapes += [(((n, 0),), seqs, 50 * seqs) for n in (40, 100, 300, 600, 1000) for seqs in (0, 4)]
    trace = []
    for i, (chunks, seqs, ctx) in enumerate(shapes):  # each shape alone, then on both workers at once
        alone = base.step_s(list(chunks), seqs, ctx)
        row = [[list(c) for c in chunks], seqs, ctx]
        trace.append([*row, alone, None, "a", 100.0 * i])
        trace += [[*row, 1.25 * alone, None, w, 100.0 * i + 50] for w in ("a", "b")]  # slowdown 0.25
    result = tmp_path / "result.json"
    result.write_text(json.dumps({"runs": [{"steps": {"real": {"trace": trace}}}], "requests_per_run": 4,
                                  "costs": "sim/data/this_machine.json"}))

    def fitted(slowdown: float) -> dict:
        out = str(tmp_path / "f.json")
        return fit(parse_args(["fit", "--result", str(result), "--out", out, "--slowdown", str(slowdown)]))

    assert fitted(0.0)["fit_relative_error_median"] > 0.05  # one price per shape cannot be both
    out = fitted(0.25)
    assert out["fit_relative_error_p90"] < 1e-6
    costs = load_costs(tmp_path / "f.json")
    assert costs.step.shared_machine_slowdown == 0.25
    for chunks, seqs, ctx in shapes:  # the prices are those of a step alone
        assert abs(costs.step_s(list(chunks), seqs, ctx) / base.step_s(list(chunks), seqs, ctx) - 1) < 1e-6
