"""The simulator's mechanisms against hand-computed timelines (docs/simulator.md).

Costs here are round numbers: a step is 10 ms + 1 ms per prefill token + 1 ms per decoding
sequence; a transfer is 0.5 ms per layer (2 layers) + 1 ms per token (1000 bytes at 1 MB/s).
Blocks hold 4 tokens. Every test ends with the leak check: no block still referenced.
"""

from __future__ import annotations

import pytest

from loadtest.stats import SLO, build_report
from sim.cluster import ClusterShape, simulate
from sim.costs import CostModel, Hardware, RequestCosts, StepCosts, TransferCosts
from sim.workload import SimRequest, reply_tokens

MS = 1e-3


def make_costs(num_blocks: int = 64, budget: int = 2048, slowdown: float = 0.0,
               per_machine: int = 1) -> CostModel:
    return CostModel(StepCosts(base_s=10 * MS, prefill_token_s=1 * MS, decode_seq_s=1 * MS,
                               shared_machine_slowdown=slowdown),
                     TransferCosts(bandwidth_bytes_per_s=1e6, frame_latency_s=0.5 * MS),
                     Hardware(kv_bytes_per_token=1000, num_layers=2, num_blocks=num_blocks, block_size=4,
                              max_num_batched_tokens=budget, workers_per_machine=per_machine))


def make_request(index: int, prompt: int | tuple[int, ...], reply: int, arrival_s: float = 0.0) -> SimRequest:
    ids = prompt if isinstance(prompt, tuple) else tuple(5000 + 100 * index + i for i in range(prompt))
    return SimRequest(index, arrival_s, ids, reply_tokens(index, reply))


def run(requests, shape, costs):
    result = simulate(requests, shape, costs)
    assert result.leaked_blocks == 0
    return result


def ms(times) -> list[float]:
    return [round(t * 1e3, 6) for t in times]


def test_a_single_request_colocated_prefills_in_one_step_then_decodes_one_token_a_step():
    r = run([make_request(0, 8, 3)], ClusterShape(0, 1), make_costs()).records[0]
    # prefill 8 tokens: 10 + 8 = 18 ms; each decode step: 10 + 1 = 11 ms
    assert ms(r.token_times_s) == [18, 29, 40]
    assert r.ttft_ms == pytest.approx(18) and r.itl_ms == pytest.approx([11, 11])


def test_a_requests_overhead_delays_its_placement_so_its_first_token_and_not_its_itl():
    from dataclasses import replace
    costs = replace(make_costs(), request=RequestCosts(overhead_s=4 * MS))
    a, b = run([make_request(0, 8, 3), make_request(1, 8, 2, arrival_s=10 * MS)], ClusterShape(0, 1),
               costs).records
    # A reaches the worker at 4 ms: prefill 18 ms, then 11 ms a token. B reaches it at 14 ms, during
    # A's prefill step, and shares the next step: A's decode + B's 8 tokens (10 + 1 + 8 = 19 ms)
    assert ms(a.token_times_s) == [22, 41, 53] and ms(b.token_times_s) == [41, 53]
    assert a.ttft_ms == pytest.approx(22) and b.ttft_ms == pytest.approx(31)


def test_a_single_request_disaggregated_waits_for_its_transfer_before_the_first_token():
    shape = ClusterShape(1, 1, routing="least_load", min_remote_prefill_tokens=1)
    r = run([make_request(0, 8, 3)], shape, make_costs()).records[0]
    # P: 18 ms; transfer of 8 tokens: 2 x 0.5 ms + 8 x 1000 B / 1 MB/s = 9 ms; D decodes 11 ms a step
    assert ms(r.token_times_s) == [27, 38, 49]
    assert (r.prefill_worker, r.decode_worker) == ("prefill-0", "decode-0")


def test_two_requests_contend_the_second_waits_for_the_step_in_flight_then_shares_one():
    result = run([make_request(0, 8, 2), make_request(1, 8, 2)], ClusterShape(0, 1), make_costs())
    # A's arrival starts a step at once (10 + 8 = 18 ms); B, due at the same instant, waits for it,
    # then shares one step: A's decode + B's 8 tokens (10 + 1 + 8 = 19 ms); B decodes alone (11 ms)
    assert [ms(r.token_times_s) for r in result.records] == [[18, 37], [37, 48]]
    assert (result.steps, ms([result.step_seconds])) == (3, [48])  # the worker's busy time, step by step


def test_two_workers_stepping_at_once_on_one_machine_slow_each_other_over_their_overlap():
    requests = [make_request(0, 8, 2), make_request(1, 8, 2)]
    apart = run(requests, ClusterShape(0, 2, routing="least_load"), make_costs(slowdown=0.5))
    assert [ms(r.token_times_s) for r in apart.records] == [[18, 29], [18, 29]]  # a machine each
    result = run(requests, ClusterShape(0, 2, routing="least_load"), make_costs(slowdown=0.5, per_machine=2))
    a, b = result.records
    assert {a.decode_worker, b.decode_worker} == {"decode-0", "decode-1"}
    # both prefills (18 ms) run together for all 18 ms: each takes 18 + 0.5 x 18 = 27 ms. The first to
    # finish starts its decode (11 ms) while the other's event at 27 ms is still due (no overlap left);
    # the second's decode then overlaps the first's by all 11 ms: both take 11 + 5.5 ms, to 43.5 ms
    assert ms(a.token_times_s) == ms(b.token_times_s) == [27, 43.5]
    assert ms([result.step_seconds]) == [2 * (27 + 16.5)]


def test_a_traced_run_keeps_each_step_its_shape_start_and_duration_stretches_included():
    from pdserve.engine.scheduler import StepShape

    requests = [make_request(0, 8, 2), make_request(1, 8, 2)]
    one = simulate(requests, ClusterShape(0, 1), make_costs(), trace_steps=True)
    # the contending pair above: A's prefill; A's decode (its 9th position) with B's 8 tokens; B's decode
    assert [(s.worker_id, ms([s.start_s, s.seconds]), s.shape) for s in one.steps_trace] == [
        ("decode-0", [0, 18], StepShape(((8, 0),))),
        ("decode-0", [18, 19], StepShape(((8, 0),), 1, 9)),
        ("decode-0", [37, 11], StepShape((), 1, 9)),
    ]
    assert simulate(requests, ClusterShape(0, 1), make_costs()).steps_trace == ()  # off by default
    shared = simulate(requests, ClusterShape(0, 2, routing="least_load"),
                      make_costs(slowdown=0.5, per_machine=2), trace_steps=True)
    # the shared machine above: each prefill stretched from 18 to 27 ms, and the decodes to 16.5
    assert sorted(ms([s.seconds])[0] for s in shared.steps_trace) == [16.5, 16.5, 27, 27]


def test_a_small_token_budget_chunks_the_second_prefill_behind_the_first_decode():
    rs = run([make_request(0, 8, 2), make_request(1, 8, 1)], ClusterShape(0, 1), make_costs(budget=8)).records
    # step 1: A's 8 tokens (18 ms). step 2: A decodes 1 + B's first 7 tokens (10 + 1 + 7 = 18 ms).
    # step 3: B's last prompt token (10 + 1 = 11 ms) samples B's first token.
    assert ms(rs[0].token_times_s) == [18, 36]
    assert ms(rs[1].token_times_s) == [47]


def test_a_full_pool_preempts_the_newest_which_recomputes_past_its_cached_prefix():
    # 4 blocks of 4 tokens; two 6-token prompts take 2 blocks each; at token 9 A needs a third block
    result = run([make_request(0, 6, 4), make_request(1, 6, 4)], ClusterShape(0, 1), make_costs(num_blocks=4))
    a, b = result.records
    assert result.preemptions == 1
    # steps: A's prefill 16 ms; A's decode + B's prefill 10 + 1 + 6 = 17; both decode 12 (45 ms);
    # A needs a third block: B (the newest) is preempted; A alone 11 (A done at 56)
    assert ms(a.token_times_s) == [16, 33, 45, 56]
    # B returns with 8 tokens: its full first block stayed cached (its partial one went back FREE and
    # A took that one), so it recomputes 4 tokens (10 + 4 = 14 ms, 70) and decodes once more (81)
    assert ms(b.token_times_s) == [33, 45, 70, 81]


def test_a_prefix_hit_skips_the_cached_blocks_and_the_router_sends_the_prompt_where_they_are():
    first = make_request(0, 12, 1)
    second = make_request(1, (*first.prompt[:8], 7, 7, 7, 7), 1, arrival_s=1.0)
    result = run([first, second], ClusterShape(0, 2), make_costs())
    a, b = result.records
    assert b.decode_worker == a.decode_worker
    # 12 - 8 cached tokens: 10 + 4 = 14 ms
    assert b.ttft_ms == pytest.approx(14)
    assert b.usage["cached_tokens"] == 8
    report = build_report(result.records, duration_s=result.duration_s, slo=SLO())
    assert report["prefix_hit_rate"] == pytest.approx(8 / 24, abs=1e-3)  # rounded


def test_conditional_disaggregation_keeps_a_short_prompt_on_the_decode_worker():
    short, long = make_request(0, 100, 1), make_request(1, 400, 1, arrival_s=1.0)
    a, b = run([short, long], ClusterShape(1, 1), make_costs(num_blocks=256)).records
    # router/scoring.py: fewer than local_prefill_max_tokens (256) uncached tokens stay on D
    assert a.prefill_worker is None and b.prefill_worker == "prefill-0"


def test_admission_refuses_a_request_when_every_decode_worker_is_at_its_bound():
    shape = ClusterShape(0, 1, max_in_flight_per_decode=1)
    a, b = run([make_request(0, 8, 2), make_request(1, 8, 2)], shape, make_costs()).records
    assert a.ok and b.status == "RESOURCE_EXHAUSTED"


def test_a_prompt_larger_than_the_pool_is_refused():
    (r,) = run([make_request(0, 64, 1)], ClusterShape(0, 1), make_costs(num_blocks=8)).records
    assert r.status == "RESOURCE_EXHAUSTED"


def test_a_transfer_into_a_full_decode_pool_falls_back_to_prefill_on_the_decode_worker():
    # D holds 4 blocks; A (12 tokens, 3 blocks) decodes there; B's 8-token transfer needs 2 blocks
    costs = make_costs(num_blocks=4)
    shape = ClusterShape(1, 1, routing="least_load", min_remote_prefill_tokens=10)
    a, b = run([make_request(0, 8, 6), make_request(1, 12, 1, arrival_s=0.001)], shape, costs).records
    assert a.prefill_worker is None and b.ok and b.prefill_worker is None


def test_each_step_takes_its_formula_time_times_a_spread_factor_drawn_by_the_workers_seed():
    """A single request's steps with a spread of (0.5, 1.5): every step is its hand-computed time
    (prefill 18 ms, decode 11 ms) times one of the two, and the draws repeat with the seed."""
    from dataclasses import replace

    costs = make_costs()
    spread = replace(costs, step=replace(costs.step, spread=(1.5, 0.5)))
    assert spread.step.spread == (0.5, 1.5)  # kept sorted: a quantile is an index
    records = [run([make_request(0, 8, 40)], ClusterShape(0, 1), spread).records[0] for _ in range(2)]
    assert records[0].token_times_s == records[1].token_times_s
    assert ms(records[0].token_times_s[:1]) in ([9], [27])
    assert {round(itl, 6) for itl in records[0].itl_ms} == {5.5, 16.5}  # both factors drawn in 39 steps
    other_seed = simulate([make_request(0, 8, 40)], ClusterShape(0, 1), spread, seed=7).records[0]
    assert other_seed.token_times_s != records[0].token_times_s
