"""Workers dying and draining under real streams: 1 prefill + 2 decode on local Ray, SmolLM2.

SIGKILL of a decode worker: requests that reach it before the router notices are retried on
the other decode worker (exact output); Ray restarts it under a new epoch, and its old index
entries are never counted. SIGTERM drains: the worker leaves the registry at once, takes no
new requests, and lets its in-flight streams finish.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import time

import pytest
import ray
import redis

from pdserve.client import PdserveError
from pdserve.engine.hashing import hash_blocks
from pdserve.engine.sequence import SamplingParams
from pdserve.index.redis_index import RedisPrefixIndex
from tests.conftest import make_engine
from tests.helpers.kv_audit import audit_failures
from tests.helpers.ray_cluster import client_of, start_cluster, wait_until_cluster_clean, worker_addresses

TOPICS = ["rivers", "owls", "bread", "trains", "glaciers", "violins"]


@pytest.fixture(scope="module")
def cluster_1p2d(ray_session):
    cluster = start_cluster(1, 2, routing="least_load")
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def expected(smollm_loaded):
    texts = [f"Tell me about {t} in a few sentences." for t in TOPICS]
    prompts = [smollm_loaded.tokenizer.apply_chat_template([{"role": "user", "content": x}]) for x in texts]
    results = make_engine(smollm_loaded).generate(prompts, SamplingParams(temperature=0, max_tokens=40),
                                                  detokenize=False)
    return prompts, [r.token_ids for r in results]


def describe(cluster, worker_id: str) -> dict:
    return ray.get(cluster.actors[worker_id].describe.remote(), timeout=120)


def wait_for_epoch(cluster, worker_id: str, above: int, timeout_s: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        live = {w.worker_id: w for w in cluster.registry.live_workers()}
        if worker_id in live and live[worker_id].epoch > above:
            cluster.router.directory.refresh()
            return describe(cluster, worker_id)
        time.sleep(0.2)
    raise AssertionError(f"{worker_id} did not come back with an epoch above {above}")


def held_by(cluster, prompt: list[int]) -> dict[str, int]:
    info = next(w for w in cluster.registry.live_workers() if w.role == "decode")
    salt = bytes.fromhex(info.salt)
    index = RedisPrefixIndex(redis.Redis.from_url(cluster.redis_url), cluster.spec.namespace)
    return dict(index.match(hash_blocks(prompt, info.block_size, salt)))


def test_killed_decode_worker_requests_retry_elsewhere_and_it_restarts_under_a_new_epoch(
        cluster_1p2d, expected):
    prompts, tokens = expected
    with client_of(cluster_1p2d) as client:
        warm = client.generate(token_ids=prompts[0], temperature=0, max_tokens=40, routing="least_load")
    victim = warm.decode_worker
    assert held_by(cluster_1p2d, prompts[0]).get(victim, 0) >= 1
    before = describe(cluster_1p2d, victim)

    os.kill(before["pid"], signal.SIGKILL)  # the router still lists it until its lease expires
    with client_of(cluster_1p2d) as client, cf.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(client.generate, token_ids=p, temperature=0, max_tokens=40) for p in prompts]
        done = [f.result() for f in futures]
    assert [d.token_ids for d in done] == tokens
    assert {d.decode_worker for d in done} == {"decode-0", "decode-1"} - {victim}

    after = wait_for_epoch(cluster_1p2d, victim, above=before["epoch"])
    assert after["pid"] != before["pid"]
    assert held_by(cluster_1p2d, prompts[0]).get(victim, 0) == 0  # the old epoch's entries do not count
    wait_until_cluster_clean(cluster_1p2d)
    assert not audit_failures(worker_addresses(cluster_1p2d))


def finish_or_fail(stream) -> tuple[str, object, float]:
    """("ok", completion, end time) or (status code, message, end time)."""
    try:
        return "ok", stream.result(), time.monotonic()
    except PdserveError as e:
        return e.code, str(e), time.monotonic()


def test_streams_under_way_on_a_killed_decode_worker_end_unavailable_within_10_s(cluster_1p2d, expected):
    prompts, tokens = expected
    with client_of(cluster_1p2d) as client, cf.ThreadPoolExecutor(4) as pool:
        streams = [client.stream(token_ids=p, temperature=0, max_tokens=40) for p in prompts[:4]]
        assert all(first.token_ids for first in pool.map(lambda s: next(iter(s)), streams))
        victim = "decode-1"
        before = describe(cluster_1p2d, victim)
        os.kill(before["pid"], signal.SIGKILL)
        killed_at = time.monotonic()
        ends = list(pool.map(finish_or_fail, streams))
    failed = [(code, message) for code, message, _ in ends if code != "ok"]
    assert failed and {code for code, _ in failed} == {"UNAVAILABLE"}, failed  # least_load put 2 there
    assert max(end for _, _, end in ends) - killed_at < 10.0
    for i, (code, done, _) in enumerate(ends):
        if code == "ok":
            assert done.decode_worker != victim and done.token_ids == tokens[i]
    wait_for_epoch(cluster_1p2d, victim, above=before["epoch"])
    wait_until_cluster_clean(cluster_1p2d)
    assert not audit_failures(worker_addresses(cluster_1p2d))


def test_sigterm_drains_in_flight_streams_and_routes_new_work_elsewhere(cluster_1p2d, expected):
    prompts, tokens = expected
    with client_of(cluster_1p2d) as client, cf.ThreadPoolExecutor(8) as pool:
        streams = [client.stream(token_ids=p, temperature=0, max_tokens=40) for p in prompts[:4]]
        firsts = list(pool.map(lambda s: next(iter(s)), streams))  # every stream is under way
        assert all(f.token_ids for f in firsts)
        victim = "decode-0"
        before = describe(cluster_1p2d, victim)
        os.kill(before["pid"], signal.SIGTERM)
        time.sleep(1.0)  # one registry refresh
        assert victim not in {w.worker_id for w in cluster_1p2d.router.directory.workers()}
        late = [pool.submit(client.generate, token_ids=p, temperature=0, max_tokens=8) for p in prompts[4:]]
        finished = list(pool.map(lambda s: s.result(), streams))
        assert [f.token_ids for f in finished] == tokens[:4]
        assert victim in {f.decode_worker for f in finished}  # streams it had in flight finished there
        assert {f.result().decode_worker for f in late} == {"decode-1"}
    after = wait_for_epoch(cluster_1p2d, victim, above=before["epoch"])
    assert after["pid"] != before["pid"]
    wait_until_cluster_clean(cluster_1p2d)
    assert not audit_failures(worker_addresses(cluster_1p2d))
