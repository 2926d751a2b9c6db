"""KV-aware routing on a 2 prefill + 2 decode cluster (SmolLM2, local Ray, real Redis)."""

from __future__ import annotations

import concurrent.futures as cf
import time

import pytest

from tests.helpers.kv_audit import audit_failures
from tests.helpers.ray_cluster import client_of, start_cluster, wait_until_cluster_clean, worker_addresses

SYSTEM = " ".join(f"Rule {i}: answer briefly, cite no sources, and stay polite." for i in range(64))


@pytest.fixture(scope="module")
def cluster_2p2d(ray_session):
    cluster = start_cluster(2, 2, num_blocks=1024)
    yield cluster
    cluster.stop()


def test_shared_system_prompt_is_cached_after_the_first_request(cluster_2p2d, smollm_loaded):
    system_tokens = len(smollm_loaded.tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}],
                                                                    add_generation_prompt=False))
    assert 1000 <= system_tokens <= 1100, system_tokens
    questions = [f"Question {i}: what is {i} plus {i}?" for i in range(20)]
    with client_of(cluster_2p2d) as client:
        results = [client.generate(messages=[{"role": "system", "content": SYSTEM},
                                             {"role": "user", "content": q}], temperature=0, max_tokens=8)
                   for q in questions]
    assert results[0].usage["cached_tokens"] < results[0].usage["prompt_tokens"] * 0.5
    for r in results[1:]:
        assert r.usage["cached_tokens"] >= 0.9 * r.usage["prompt_tokens"], r.usage
    wait_until_cluster_clean(cluster_2p2d)


def test_chat_turns_stay_on_their_decode_worker_without_transfer(cluster_2p2d):
    messages = [{"role": "system", "content": SYSTEM[:1500]}]
    decode_workers, prefill_workers = [], []
    with client_of(cluster_2p2d) as client:
        for turn in range(4):
            messages.append({"role": "user", "content": f"Tell me fact number {turn} about owls."})
            done = client.generate(messages=messages, temperature=0, max_tokens=24)
            messages.append({"role": "assistant", "content": done.text})
            decode_workers.append(done.decode_worker)
            prefill_workers.append(done.prefill_worker)
    assert len(set(decode_workers)) == 1, decode_workers
    assert prefill_workers[1:] == [None, None, None], prefill_workers


def test_chat_turns_alternating_between_two_routers_stay_on_one_decode_worker(cluster_2p2d, smollm_loaded):
    """Two routers over one Redis index (each with its own mirror of it): prefix affinity holds across
    them, so turns 2 to 4 go to the decode worker that holds the chat, with no transfer."""
    from dataclasses import replace

    from pdserve.client import PdserveClient
    from router.redis_backend import redis_router

    config = replace(cluster_2p2d.router.config, port=0, metrics_port=None, http_port=None)
    namespace = cluster_2p2d.spec.namespace
    second = redis_router(config, smollm_loaded.tokenizer, cluster_2p2d.redis_url, namespace)
    second.start()
    messages = [{"role": "system", "content": SYSTEM[:1400]}]
    decode_workers, prefill_workers = [], []
    try:
        with client_of(cluster_2p2d) as first, PdserveClient(second.address, timeout_s=300) as other:
            for turn in range(4):
                messages.append({"role": "user", "content": f"Tell me fact number {turn} about foxes."})
                done = (first, other)[turn % 2].generate(messages=messages, temperature=0, max_tokens=24)
                messages.append({"role": "assistant", "content": done.text})
                decode_workers.append(done.decode_worker)
                prefill_workers.append(done.prefill_worker)
    finally:
        second.stop()
    assert len(set(decode_workers)) == 1, decode_workers
    assert prefill_workers[1:] == [None, None, None], prefill_workers
    wait_until_cluster_clean(cluster_2p2d)


REDIS_DOWN_S = 30.0


def keep_asking(client, system: str, until: float, worker: int) -> list:
    """One closed-loop client: requests back to back until `until`; any failure raises."""
    done, i = [], 0
    while time.monotonic() < until:
        ask = [{"role": "system", "content": system}, {"role": "user", "content": f"Hi {worker}.{i}"}]
        done.append(client.generate(messages=ask, temperature=0, max_tokens=4))
        i += 1
    return done


def test_redis_down_30_s_under_load_then_back(cluster_2p2d):
    redis_server = cluster_2p2d.redis_server
    prompt = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a planet."}]
    with client_of(cluster_2p2d) as client:
        warm = client.generate(messages=prompt, temperature=0, max_tokens=4)
        redis_server.kill()
        until = time.monotonic() + REDIS_DOWN_S
        with cf.ThreadPoolExecutor(4) as pool:
            loops = [pool.submit(keep_asking, client, SYSTEM, until, w) for w in range(4)]
            outcomes = [o for f in loops for o in f.result()]  # raises if any request failed
        assert len(outcomes) >= 8 and all(o.finish_reason for o in outcomes)
        redis_server.start()  # same port, empty: workers re-register and resync on their next beat
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            again = client.generate(messages=prompt, temperature=0, max_tokens=4)
            if again.decode_worker == warm.decode_worker and again.prefill_worker is None:
                break
            time.sleep(0.5)
    assert again.decode_worker == warm.decode_worker and again.prefill_worker is None, "affinity lost"
    assert again.usage["cached_tokens"] >= 0.9 * again.usage["prompt_tokens"]
    wait_until_cluster_clean(cluster_2p2d)
    assert not audit_failures(worker_addresses(cluster_2p2d))
