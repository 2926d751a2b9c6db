"""Under pressure, on 1 prefill + 1 decode with small KV pools (SmolLM2, local Ray, real Redis).

Cancellation storm: 200 requests cancelled at random moments (queued, prefilling, transferring,
decoding: the test checks both sides of the first token) or cut by their deadline; a few seconds
later no worker holds a block for any of them.
Pool exhaustion: more concurrent work than both pools hold; preemption and the fallback to
prefill on the decode worker keep every output exact, and nothing deadlocks.
"""

from __future__ import annotations

import concurrent.futures as cf
import random
import threading
from collections import Counter

import pytest

from pdserve.client import PdserveError
from pdserve.engine.sequence import SamplingParams
from pdserve.worker.scrubber import AuditSchedule
from tests.conftest import make_engine
from tests.helpers.kv_audit import audit_failures
from tests.helpers.ray_cluster import (
    client_of,
    start_cluster,
    wait_until_cluster_clean,
    worker_addresses,
    worker_status,
)

POOL_BLOCKS = 64  # 1,024 tokens a worker


@pytest.fixture(scope="module")
def small_pools(ray_session):
    # the background KV audit runs through both storms, at its default share of the time
    cluster = start_cluster(1, 1, num_blocks=POOL_BLOCKS, routing="least_load",
                            audit=AuditSchedule(interval_s=0.5))
    yield cluster
    cluster.stop()


def storm_prompt(rng: random.Random) -> list[int]:
    length = rng.choice([8, 40, 100, 250])  # short ones prefill on the decode worker, long ones transfer
    return [rng.randrange(1000, 30000) for _ in range(length)]


def cancel_at_random(client, rng: random.Random) -> str:
    """Start one request and end it early: a short deadline; a cancel on a timer, which lands
    wherever the request is by then (queued, prefilling, transferring, decoding); or a cancel
    after a random number of tokens, which lands while it decodes."""
    prompt, max_tokens = storm_prompt(rng), rng.choice([4, 16, 32])
    way = rng.random()
    if way < 0.25:
        try:
            client.generate(token_ids=prompt, max_tokens=max_tokens, ignore_eos=True,
                            timeout_s=rng.uniform(0.05, 1.5))
            return "finished"
        except PdserveError as e:
            return e.code
    stream = client.stream(token_ids=prompt, max_tokens=max_tokens, ignore_eos=True)
    if way < 0.85:
        return _cancel_on_a_timer(stream, rng.uniform(0.0, 1.5))
    after = rng.randint(1, 3)
    for tokens, _ in enumerate(stream, start=1):
        if tokens == after:
            stream.cancel()
            return "cancelled streaming"
    return "finished"


def _cancel_on_a_timer(stream, delay_s: float) -> str:
    cancelled = threading.Event()
    def cancel() -> None:
        cancelled.set()
        stream.cancel()
    timer = threading.Timer(delay_s, cancel)
    timer.start()
    tokens = sum(1 for _ in stream)
    timer.cancel()
    if not cancelled.is_set():
        return "finished"
    return "cancelled streaming" if tokens else "cancelled before its first token"


def test_cancellation_storm_leaks_no_block(small_pools):
    rng = random.Random(7)
    seeds = [rng.random() for _ in range(200)]
    with client_of(small_pools) as client, cf.ThreadPoolExecutor(16) as pool:
        outcomes = list(pool.map(lambda s: cancel_at_random(client, random.Random(s)), seeds))
    assert len(outcomes) == 200
    counts = Counter(outcomes)
    assert set(counts) <= {"finished", "cancelled streaming", "cancelled before its first token",
                           "DEADLINE_EXCEEDED"}, counts
    # every phase is hit: before the first token (queued, prefilling, transferring) and while decoding
    assert counts["DEADLINE_EXCEEDED"] > 0, counts
    # (seed 7 draws 27 cancels after 1-3 tokens; the timer's cancels land mostly before the first)
    assert counts["cancelled streaming"] >= 27 and counts["cancelled before its first token"] > 50, counts
    wait_until_cluster_clean(small_pools, timeout_s=30.0)
    for status in worker_status(small_pools).values():
        assert status.free_blocks == status.num_blocks == POOL_BLOCKS
    assert small_pools.router.servicer.requests_in_flight == 0
    assert not audit_failures(worker_addresses(small_pools))


def test_pool_exhaustion_preempts_and_stays_exact(small_pools, smollm_loaded):
    rng = random.Random(11)
    prompts = [[rng.randrange(1000, 30000) for _ in range(rng.randint(97, 112))] for _ in range(8)]
    sampling = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    expected = [r.token_ids for r in make_engine(smollm_loaded).generate(prompts, sampling, detokenize=False)]
    # 8 prompts of 7 blocks fit the 64-block pools together (56 blocks), so all are admitted;
    # growing to ~11 blocks each (88 in all) cannot fit, so the newest are preempted.
    with client_of(small_pools) as client, cf.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(client.generate, token_ids=p, temperature=0, max_tokens=64, ignore_eos=True)
                   for p in prompts]
        done = [f.result(timeout=600) for f in futures]
    assert [d.token_ids for d in done] == expected
    statuses = worker_status(small_pools).values()
    assert sum(s.preemptions_total for s in statuses) > 0
    assert all(s.kv_audited_blocks_total > 0 for s in statuses)  # the background scrubber ran
    assert all(s.kv_audit_mismatches_total == 0 for s in statuses)
    wait_until_cluster_clean(small_pools)
    assert not audit_failures(worker_addresses(small_pools))
