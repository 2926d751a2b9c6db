"""Injected KV transfer faults (prefill_worker/faults.py): every one is detected, no corrupted
token reaches a client, and the failure counters equal the injections, kind by kind.

First the plan and the injector on the loopback transport (milliseconds), then a router and
two tiny-model workers in one process over real gRPC, then a prefill worker in another
process SIGKILLed while it streams.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from decode_worker.role import DecodeRole
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.sequence import SamplingParams
from pdserve.metrics import scrape
from pdserve.worker.server import WorkerConfig, WorkerServer
from prefill_worker.faults import (
    EXPECTED_FAILURE,
    Chance,
    EveryNth,
    FaultInjector,
    FaultKind,
    FaultPlan,
    FaultRule,
    Matching,
    RequestIds,
)
from prefill_worker.role import PrefillConfig, PrefillRole
from router.config import RequestDeadlines
from router.server import RouterServer
from tests.helpers.cluster import generate, generate_request, metric_value, running_cluster, start_router
from tests.helpers.processes import WorkerProcess
from tests.helpers.rig import Gate, assert_no_wrong_kv, cached_prompt_blocks, reference_tokens, start_rig
from tests.helpers.waiting import eventually
from tests.helpers.workers import wait_until_clean, worker_info

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPT = list(range(300, 350))  # 50 tokens: 4 blocks; 2 layers -> 2 LAYER frames (one per layer)


def injector(*rules: FaultRule, seed: int = 0, sleep=time.sleep) -> FaultInjector:
    return FaultInjector(FaultPlan(rules, seed), sleep=sleep)


def chosen(inj: FaultInjector, request_ids: list[str]) -> list[str]:
    """The request ids whose transfer the injector hits, asked in order."""
    return [rid for rid in request_ids if inj.choose(rid) is not None]


# --- the plan --------------------------------------------------------------------------------------
def test_selectors_pick_exactly_their_transfers():
    ids = [f"r{i}" for i in range(1, 10)]
    assert chosen(injector(FaultRule(FaultKind.DROP, EveryNth(3))), ids) == ["r3", "r6", "r9"]
    assert chosen(injector(FaultRule(FaultKind.DROP, RequestIds(["r2", "r5"]))), ids) == ["r2", "r5"]
    assert chosen(injector(FaultRule(FaultKind.DROP, Matching(lambda r: r.endswith("7")))), ids) == ["r7"]
    assert chosen(injector(FaultRule(FaultKind.DROP, Chance(0.0))), ids) == []
    assert chosen(injector(FaultRule(FaultKind.DROP, Chance(1.0))), ids) == ids


def test_chance_is_reproducible_from_the_seed():
    ids = [f"r{i}" for i in range(200)]
    first = chosen(injector(FaultRule(FaultKind.CORRUPT, Chance(0.25)), seed=7), ids)
    assert first == chosen(injector(FaultRule(FaultKind.CORRUPT, Chance(0.25)), seed=7), ids)
    assert first != chosen(injector(FaultRule(FaultKind.CORRUPT, Chance(0.25)), seed=8), ids)
    assert 30 <= len(first) <= 70


def test_first_matching_rule_wins_and_hits_once():
    inj = injector(FaultRule(FaultKind.DELAY, RequestIds({"a"})), FaultRule(FaultKind.DROP, EveryNth(1)))
    assert inj.choose("a").kind is FaultKind.DELAY
    assert inj.choose("b").kind is FaultKind.DROP


@pytest.mark.parametrize("build, message", [
    (lambda: FaultPlan(()), "at least one FaultRule"),
    (lambda: EveryNth(0), "EveryNth.n must be >= 1"),
    (lambda: Chance(1.5), r"Chance.probability must be in \[0, 1\]"),
    (lambda: FaultRule(FaultKind.DROP, EveryNth(1), at_frame=-1), "at_frame must be >= 0"),
    (lambda: PrefillConfig(transfer_timeout_s=0), "transfer_timeout_s must be > 0"),
])
def test_bad_plans_are_refused_with_the_reason(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_a_worker_has_no_faults_unless_built_with_a_plan():
    assert PrefillConfig().fault_plan is None and PrefillRole().faults is None


# --- the injector on the loopback and gRPC transports --------------------------------------------------
TRANSPORTS = ("loopback", "grpc")


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("kind", [FaultKind.DROP, FaultKind.CORRUPT])
@pytest.mark.parametrize("at_frame", [0, 1])
def test_fault_is_reported_by_both_ends_and_recompute_is_exact(tiny_loaded, transport, kind, at_frame):
    rig = start_rig(tiny_loaded, transport, rules=(FaultRule(kind, RequestIds({"hit"}), at_frame=at_frame),))
    try:
        with pytest.raises(grpc.RpcError):
            rig.remote_prefill("hit", PROMPT, GREEDY)
        expected = EXPECTED_FAILURE[kind].value
        # NOTE: a dropped stream reaches the receiver as a cancel just after the sender gave up
        eventually(lambda: rig.decode.status().transfer_outcomes == {expected: 1}, 5, "D counted the failure")
        assert rig.prefill.status().send_outcomes == {expected: 1}
        assert rig.prefill.role.faults.injected == {kind.value: 1}
        assert cached_prompt_blocks(rig.decode, PROMPT) == 0
        tokens, used = rig.decode_tokens("hit", PROMPT, sampling=GREEDY)
        assert not used and tokens == reference_tokens(tiny_loaded, PROMPT, GREEDY)
        wait_until_clean(rig.prefill, rig.decode)
        assert_no_wrong_kv(rig.prefill, rig.decode)
    finally:
        rig.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("rule", [
    FaultRule(FaultKind.CORRUPT, RequestIds({"someone-else"})),
    FaultRule(FaultKind.DROP, EveryNth(1), at_frame=2),  # past the last of the 2 LAYER frames
], ids=["not-selected", "frame-never-reached"])
def test_transfers_the_plan_does_not_hit_go_through_untouched(tiny_loaded, transport, rule):
    rig = start_rig(tiny_loaded, transport, rules=(rule,))
    try:
        reply = rig.remote_prefill("clean", PROMPT, GREEDY)
        tokens, used = rig.decode_tokens("clean", PROMPT, reply, GREEDY)
        assert used and tokens == reference_tokens(tiny_loaded, PROMPT, GREEDY)
        assert rig.prefill.role.faults.injected == {}
        wait_until_clean(rig.prefill, rig.decode)
        assert_no_wrong_kv(rig.prefill, rig.decode)
    finally:
        rig.close()


def test_delay_sleeps_past_the_push_deadline(tiny_loaded):
    slept: list[float] = []
    delay = FaultRule(FaultKind.DELAY, EveryNth(1), overshoot_s=0.25)
    rig = start_rig(tiny_loaded, "loopback", rules=(delay,), transfer_timeout_s=2.0, fault_sleep=slept.append)
    try:
        reply = rig.remote_prefill("late", PROMPT, GREEDY)  # loopback has no deadline: it completes
        assert slept == [2.25] and rig.prefill.role.faults.injected == {"delay": 1}
        rig.decode_tokens("late", PROMPT, reply, GREEDY)
        wait_until_clean(rig.prefill, rig.decode)
        assert_no_wrong_kv(rig.prefill, rig.decode)
    finally:
        rig.close()


# --- a router, a faulty prefill worker and a decode worker over real gRPC ---------------------------
TRANSFER_DEADLINE_S = 3.0
# request index -> the LAYER frame its fault hits (each transfer has 2: one per layer)
DROPPED = {1: 0, 6: 1}
CORRUPTED = {2: 0, 7: 1}
DELAYED = {3: 0, 8: 1}
N_REQUESTS = 12


def rid(i: int) -> str:
    return f"req-{i}"


def client_request(i: int) -> Matching:
    """Workers see the client's request id, or (newer routers) the client's id plus ".suffix"."""
    return Matching(lambda worker_rid: worker_rid.partition(".")[0] == rid(i))


def fault_plan() -> FaultPlan:
    rules = [FaultRule(kind, client_request(i), at_frame=frame)
             for kind, hit in ((FaultKind.DROP, DROPPED), (FaultKind.CORRUPT, CORRUPTED),
                               (FaultKind.DELAY, DELAYED))
             for i, frame in hit.items()]
    return FaultPlan(tuple(rules))


def distinct_prompt(i: int) -> list[int]:
    """48 + 3i tokens, a different first block for each i: prefilled remotely, no shared prefix."""
    return [(i * 37 + j * 11) % 500 + 10 for j in range(48 + 3 * i)]


ENGINE = EngineConfig(cache=CacheConfig(num_blocks=128), device="cpu")


def faulty_prefill(loaded, fault_sleep=None, **prefill_config) -> WorkerServer:
    """A prefill worker whose role has a fault plan (PrefillConfig fields, fault_plan among them);
    fault_sleep: what a DELAY waits with (default: time.sleep)."""
    role = PrefillRole(PrefillConfig(**prefill_config), fault_sleep=fault_sleep or time.sleep)
    return WorkerServer(WorkerConfig("prefill", ENGINE), role, loaded)


@pytest.fixture()
def faulty_cluster(tiny_loaded):
    prefill = faulty_prefill(tiny_loaded, transfer_timeout_s=TRANSFER_DEADLINE_S, fault_plan=fault_plan())
    with running_cluster(tiny_loaded, workers=(prefill, WorkerConfig("decode")), metrics_port=0) as cluster:
        yield cluster.router, cluster.prefill, cluster.decode


def ask(router: RouterServer, request_id: str, prompt: list[int], timeout: float = 60):
    """A greedy request of MAX_TOKENS through the router: its replies."""
    return generate(router, generate_request(prompt, MAX_TOKENS, request_id), timeout)


def test_injected_faults_are_all_detected_counted_and_recomputed_exactly(faulty_cluster, tiny_loaded):
    router, prefill, decode = faulty_cluster
    prompts = {rid(i): distinct_prompt(i) for i in range(N_REQUESTS)}
    expected = {r: reference_tokens(tiny_loaded, p, GREEDY) for r, p in prompts.items()}
    with ThreadPoolExecutor(N_REQUESTS) as pool:
        replies = dict(zip(prompts, pool.map(lambda r: ask(router, r, prompts[r]), prompts)))

    faulted = {rid(i) for hit in (DROPPED, CORRUPTED, DELAYED) for i in hit}
    for r, stream in replies.items():
        assert [t for reply in stream for t in reply.token_ids] == expected[r], r  # zero corrupted tokens
        assert stream[-1].prefill_worker == ("" if r in faulted else prefill.config.worker_id), r

    n = len(DROPPED)  # of each kind
    assert prefill.role.faults.injected == {"drop": n, "corrupt": n, "delay": n}
    outcomes = {"done": N_REQUESTS - 3 * n, "CANCELLED": n, "DATA_LOSS": n, "DEADLINE_EXCEEDED": n}
    eventually(lambda: sum(decode.status().transfer_outcomes.values()) == N_REQUESTS, 5,
               "the decode worker counted every push")
    assert dict(decode.status().transfer_outcomes) == outcomes
    assert dict(prefill.status().send_outcomes) == outcomes

    d = scrape(f"http://{decode.status().metrics_address}/metrics")
    p = scrape(f"http://{prefill.status().metrics_address}/metrics")
    assert metric_value(d, "pdserve_worker_kv_transfer_failures_total") == 3 * n
    for outcome, count in outcomes.items():
        received = metric_value(d, "pdserve_worker_kv_transfers_received_total", outcome=outcome)
        sent = metric_value(p, "pdserve_worker_kv_transfers_sent_total", outcome=outcome)
        assert (received, sent) == (count, count), outcome
    m = scrape(f"http://{router.metrics_address}/metrics")
    assert metric_value(m, "pdserve_router_remote_prefills_total", outcome="fallback") == 3 * n
    assert metric_value(m, "pdserve_router_remote_prefills_total", outcome="ok") == N_REQUESTS - 3 * n
    assert metric_value(m, "pdserve_router_requests_total", code="OK") == N_REQUESTS
    wait_until_clean(prefill, decode, timeout_s=2)
    assert_no_wrong_kv(prefill, decode)


# --- a prefill worker SIGKILLed mid-transfer ------------------------------------------------------------
def test_prefill_worker_killed_mid_transfer_frees_the_reservation_and_output_is_exact(
        tiny_loaded, tiny_model_dir):
    # DELAY makes "mid-transfer" deterministic: BEGIN and layer 0 are sent, then the sender sleeps.
    plan = FaultPlan((FaultRule(FaultKind.DELAY, EveryNth(1), at_frame=1),))  # its only transfer
    prefill = WorkerProcess(str(tiny_model_dir), role="prefill", fault_plan=plan,
                            transfer_timeout_s=TRANSFER_DEADLINE_S)
    decode = WorkerServer(WorkerConfig("decode", ENGINE), DecodeRole(), tiny_loaded)
    router = None
    try:
        decode.start()
        router = start_router(tiny_loaded, [worker_info(prefill), worker_info(decode)], metrics_port=0)
        prompt = distinct_prompt(5)
        result: dict[str, list] = {}
        client = threading.Thread(target=lambda: result.update(replies=ask(router, "victim", prompt)))
        client.start()
        eventually(lambda: decode.status().used_blocks > 0, 30, "the transfer reserved blocks on decode")
        prefill.kill()
        killed = time.monotonic()
        eventually(lambda: sum(decode.status().transfer_outcomes.values()) == 1, TRANSFER_DEADLINE_S + 1,
                   "the decode worker ended the transfer")
        freed_after = time.monotonic() - killed
        client.join(30)

        assert freed_after < TRANSFER_DEADLINE_S  # the disconnect freed it, not the deadline
        assert dict(decode.status().transfer_outcomes) == {"CANCELLED": 1}
        replies = result["replies"]
        tokens = [t for reply in replies for t in reply.token_ids]
        assert tokens == reference_tokens(tiny_loaded, prompt, GREEDY)
        assert replies[-1].prefill_worker == "" and replies[-1].decode_worker == decode.config.worker_id
        m = scrape(f"http://{router.metrics_address}/metrics")
        assert metric_value(m, "pdserve_router_remote_prefills_total", outcome="fallback") == 1
        wait_until_clean(decode, timeout_s=2)
        assert_no_wrong_kv(decode)
    finally:
        if router is not None:
            router.stop()
        decode.stop()
        prefill.close()


def test_kv_parked_for_a_request_prefilled_here_after_all_is_freed_with_it(tiny_loaded):
    """The prefill worker died after the transfer completed but before it answered: the router
    falls back to prefill on the decode worker, whose parked KV can never be resumed. It goes
    when the request ends (the Decode call's abort), not at its TTL."""
    rig = start_rig(tiny_loaded, "grpc", parked_ttl_s=300)
    try:
        rig.remote_prefill("stranded", PROMPT, GREEDY)
        assert rig.decode.status().parked_transfers == 1
        tokens, used = rig.decode_tokens("stranded", PROMPT, sampling=GREEDY)  # prefill_here
        assert not used and tokens == reference_tokens(tiny_loaded, PROMPT, GREEDY)
        wait_until_clean(rig.prefill, rig.decode, timeout_s=2)
        assert_no_wrong_kv(rig.prefill, rig.decode)
    finally:
        rig.close()


# --- a transfer that stalls: the prefill phase has its own, shorter deadline -----------------------------
def test_a_stalled_transfer_falls_back_to_local_prefill_well_inside_the_request_deadline(tiny_loaded):
    """The prefill worker's transfer is held (Gate) and never finishes. The router gives the prefill
    phase half the request's remaining time, then prefills on the decode worker: the client gets
    the exact answer, long before its own deadline, and no worker keeps a block."""
    gate = Gate()
    plan = FaultPlan((FaultRule(FaultKind.DELAY, client_request(0)),))
    prefill = faulty_prefill(tiny_loaded, fault_sleep=gate, fault_plan=plan)
    with running_cluster(tiny_loaded, workers=(prefill, WorkerConfig("decode")), metrics_port=0,
                         deadlines=RequestDeadlines(prefill_deadline_fraction=0.5)) as cluster:
        try:
            prompt, request_deadline_s = distinct_prompt(0), 12.0
            started = time.monotonic()
            replies = ask(cluster.router, rid(0), prompt, timeout=request_deadline_s)
            elapsed = time.monotonic() - started
            assert gate.reached.is_set(), "the transfer was never held"
            assert [t for r in replies for t in r.token_ids] == reference_tokens(tiny_loaded, prompt, GREEDY)
            assert replies[-1].prefill_worker == "", "it did not fall back to the decode worker"
            assert elapsed < 0.5 * request_deadline_s + 3.0, \
                f"took {elapsed:.1f} s of the {request_deadline_s} s"
            m = scrape(f"http://{cluster.router.metrics_address}/metrics")
            assert metric_value(m, "pdserve_router_remote_prefills_total", outcome="fallback") == 1
            gate.open()
            wait_until_clean(*cluster.workers)
            assert_no_wrong_kv(*cluster.workers)
        finally:
            gate.open()
