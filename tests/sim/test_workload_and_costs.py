"""Arrivals (the load tester's workloads, traces) and the cost files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest.workloads import make_workload
from sim.cluster import ClusterShape, simulate
from sim.costs import RequestCosts, load_costs, save_costs
from sim.workload import from_trace, from_workload
from tests.sim.test_mechanisms import make_costs

GPU_COSTS = Path(__file__).resolve().parents[2] / "sim" / "data" / "h100_llama8b.json"


def test_a_run_is_deterministic_given_its_seed():
    reqs = from_workload(make_workload("shared-prefix", {"num_prefixes": 3}), 60, 20.0, seed=1)
    a, b = (simulate(reqs, ClusterShape(1, 2), make_costs(num_blocks=512), seed=1) for _ in range(2))
    assert a.records == b.records
    assert len({r.decode_worker for r in a.records}) == 2


def test_multi_turn_sends_the_next_turn_only_after_the_reply_and_it_hits_the_history():
    reqs = from_workload(make_workload("multi-turn", {"turns": 2}), 4, 100.0, seed=0)
    assert reqs[2].prompt[:len(reqs[0].prompt)] == reqs[0].prompt  # turn 2 carries turn 1 and its reply
    records = simulate(reqs, ClusterShape(0, 1), make_costs(num_blocks=512)).records
    assert records[2].send_s >= records[0].end_s
    assert records[2].usage["cached_tokens"] >= len(reqs[0].prompt) // 4 * 4 - 4


def test_the_arrivals_are_the_load_testers_own(monkeypatch):
    import random

    from loadtest.arrivals import Bounds, scheduled_offsets
    reqs = from_workload(make_workload("synthetic"), 5, 3.0, seed=7)
    assert [r.arrival_s for r in reqs] == scheduled_offsets(3.0, random.Random("7/arrivals"), Bounds(5))


def test_a_trace_shares_each_prefix_ids_leading_tokens(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_tokens,prefix_id,output_tokens,prefix_tokens\n"
                     "0.5,40,a,3,32\n0.0,50,a,2,32\n1.0,20,,1,\n")
    a1, a0, other = sorted(from_trace(trace), key=lambda r: len(r.prompt), reverse=True)[::1][:3]
    assert a1.prompt[:32] == a0.prompt[:32] and a1.prompt[32] != a0.prompt[32]
    assert [r.arrival_s for r in from_trace(trace)] == [0.0, 0.5, 1.0]
    assert len(other.prompt) == 20 and len(other.reply) == 1


def test_a_trace_row_with_no_output_is_an_error_that_names_it(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 0}) + "\n")
    with pytest.raises(ValueError, match="row 1"):
        from_trace(trace)


def test_a_cost_model_survives_its_json(tmp_path):
    from dataclasses import replace
    costs = make_costs(slowdown=0.1, per_machine=2)
    costs = replace(costs, step=replace(costs.step, spread=(0.9, 1.0, 1.2)), request=RequestCosts(0.008))
    save_costs(costs, tmp_path / "c.json")
    assert load_costs(tmp_path / "c.json") == costs
    assert load_costs(GPU_COSTS).request.overhead_s == 0.0  # no key in the file: no time outside the steps
    assert load_costs(GPU_COSTS).step.spread == ()  # no key in the file: every step its formula's time
    assert load_costs(GPU_COSTS).step.shared_machine_slowdown == 0.0  # no key in the file: a GPU each
    # transfer_s: frames x latency + bytes / bandwidth
    assert costs.transfer_s(8) == pytest.approx(2 * 0.5e-3 + 8 * 1000 / 1e6)


def test_the_gpu_cost_file_cites_its_source_and_says_it_was_not_measured_here():
    costs = load_costs(GPU_COSTS)
    assert "not measured" in costs.source["note"].lower() and costs.source["references"]
    # memory-bound decode: a batch of 64 costs well under twice a batch of 1
    assert costs.step_s([], 64, 64 * 1024) < 2 * costs.step_s([], 1, 1024)


def test_the_token_curve_interpolates_between_its_knots_and_extends_its_last_segment(tmp_path):
    from dataclasses import replace

    from sim.costs import StepCosts
    step = StepCosts(0.0, 0.0, decode_context_s=0.01, token_curve=((1, 0.04), (4, 0.10), (8, 0.12)))
    assert [step.curve_s(r) for r in (0, 1, 4, 8)] == [0.0, 0.04, 0.10, 0.12]
    assert step.curve_s(2) == pytest.approx(0.06) and step.curve_s(6) == pytest.approx(0.11)
    assert step.curve_s(12) == pytest.approx(0.14)  # past 8: the 4..8 slope, 5 ms a row
    costs = replace(make_costs(), step=step)
    # a step of 2 decoding sequences over 3,000 tokens of context and a 2-token prefill chunk: 4 rows
    assert costs.step_s([(2, 0)], 2, 3000) == pytest.approx(0.10 + 0.01 * 3)
    save_costs(costs, tmp_path / "c.json")
    assert load_costs(tmp_path / "c.json") == costs
    with pytest.raises(ValueError, match="token_curve"):
        StepCosts(0.0, 0.0, token_curve=((4, 0.1), (2, 0.2)))


def test_calibration_fits_the_curve_and_attention_terms_back_from_steps_they_timed():
    """fit_step_costs recovers known costs exactly from steps timed by them; a knot no step falls
    near is left out of the curve rather than fitted to 0."""
    from sim.costs import StepCosts
    from sim.measure.calibrate import fit_step_costs
    truth = StepCosts(0.0, 0.0, prefill_attn_s=0.002, decode_context_s=0.01,
                      token_curve=((1, 0.04), (4, 0.12), (8, 0.13), (32, 0.2), (128, 0.45)))
    # (prefill tokens, attention pairs / 1000, decoding sequences, their context / 1000)
    samples = [[0, 0, b, b * ctx] for b in (1, 4, 8) for ctx in (0.064, 0.448)]
    samples += [[n, n * (c + n / 2) / 1000, 0, 0] for n in (32, 128) for c in (0, 256)]
    samples += [[96, 20.0, 2, 1.0]]
    times = [truth.curve_s(n + b) + truth.prefill_attn_s * attn + truth.decode_context_s * ctx
             for n, attn, b, ctx in samples]
    fitted, relative = fit_step_costs(samples, times, knots=(1, 4, 8, 16, 32, 128, 4096))
    assert relative.max() < 1e-9
    assert [k for k, _ in fitted.token_curve] == [1, 4, 8, 32, 128]  # no step between 8 and 32, nor past 128
    for rows in (1, 4, 8, 32, 128):
        assert fitted.curve_s(rows) == pytest.approx(truth.curve_s(rows))
    assert fitted.prefill_attn_s == pytest.approx(0.002) and fitted.decode_context_s == pytest.approx(0.01)
    assert fitted.spread == (1.0,) * len(samples)  # every step took exactly the formula's time


def test_calibration_keeps_each_steps_time_over_the_fits_as_the_spread():
    from sim.measure.calibrate import fit_step_costs
    samples = [[0, 0, 1, 0.0]] * 4 + [[0, 0, 4, 0.0]] * 4  # two shapes, four steps each
    times = [0.040 * f for f in (0.9, 1.0, 1.0, 1.3)] + [0.100 * f for f in (1.0, 0.95, 1.05, 1.0)]
    fitted, _ = fit_step_costs(samples, times, knots=(1, 4))
    ratios = [t / fitted.curve_s(1 if i < 4 else 4) for i, t in enumerate(times)]
    assert fitted.spread == tuple(sorted(round(r, 4) for r in ratios))
    assert fitted.spread_factor(0.0) == fitted.spread[0] and fitted.spread_factor(0.999) == fitted.spread[-1]
    with pytest.raises(ValueError, match="spread must hold ratios > 0"):
        type(fitted)(0.0, 0.0, spread=(0.0, 1.0))
