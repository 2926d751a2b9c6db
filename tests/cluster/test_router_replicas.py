"""Two routers over one index (`pdserve up --routers 2`: router-1 a Ray actor), 1 prefill + 2 decode,
SmolLM2 on local Ray.

Four closed-loop clients give both routers' addresses. While streams run, both routers' status tables
agree on every worker's load report within one heartbeat. Then router-1 is SIGKILLed with streams
under way on it: every request still finishes OK with exactly the tokens of an uninterrupted run,
the streams that were on router-1 resumed through router-0 (pdserve/client.py _Resume). No block
leaks, and the KV audit finds nothing wrong.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import threading
import time

import grpc
import pytest

from pdserve.client import PdserveClient
from pdserve.engine.sequence import SamplingParams
from protos.pdserve.v1 import admin_pb2, admin_pb2_grpc
from tests.cluster.test_worker_faults import Reader, request_fields
from tests.conftest import make_engine
from tests.helpers.kv_audit import audit_failures
from tests.helpers.ray_cluster import start_cluster, wait_until_cluster_clean, worker_addresses

TOPICS = ["rivers", "owls", "bread", "trains", "glaciers", "violins", "bees", "maps"]
CLIENTS, STREAM_TOKENS = 4, 40
KILL_WINDOW = (4, 30)  # every open stream has this many tokens when router-1 is killed


@pytest.fixture(scope="module")
def cluster_2r(ray_session):
    cluster = start_cluster(1, 2, num_routers=2)
    yield cluster
    cluster.stop()


def sampling(i: int) -> SamplingParams:
    if i % 2 == 0:
        return SamplingParams(temperature=0, max_tokens=STREAM_TOKENS, ignore_eos=True)
    return SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=7 + i, max_tokens=STREAM_TOKENS,
                          ignore_eos=True)


@pytest.fixture(scope="module")
def workload(smollm_loaded):
    texts = [f"Write two sentences about {t}." for t in TOPICS]
    prompts = [smollm_loaded.tokenizer.apply_chat_template([{"role": "user", "content": x}]) for x in texts]
    params = [sampling(i) for i in range(len(prompts))]
    results = make_engine(smollm_loaded).generate(prompts, params, detokenize=False)
    return prompts, params, [r.token_ids for r in results]


def cluster_status(address: str) -> admin_pb2.ClusterStatusReply:
    with grpc.insecure_channel(address) as channel:
        return admin_pb2_grpc.AdminStub(channel).ClusterStatus(admin_pb2.ClusterStatusRequest(), timeout=10)


class ClosedLoop:
    """CLIENTS threads, each sending its share of the prompts one after another through both routers."""

    def __init__(self, addresses: str, prompts, params) -> None:
        self.addresses, self.prompts, self.params = addresses, prompts, params
        self.current: dict[int, Reader] = {}
        self.lock = threading.Lock()

    def client(self, c: int) -> list[tuple[int, str, list[int], int]]:
        done = []
        with PdserveClient(self.addresses, timeout_s=300) as client:
            for i in range(c, len(self.prompts), CLIENTS):
                reader = Reader(client.stream(token_ids=self.prompts[i], **request_fields(self.params[i])))
                with self.lock:
                    self.current[c] = reader
                code, _ = reader.read()
                done.append((i, code, reader.tokens, reader.stream.resumes))
        with self.lock:
            self.current.pop(c)
        return done

    def all_streams_in(self, window: tuple[int, int]) -> bool:
        with self.lock:
            counts = [r.count() for r in self.current.values()]
        return len(counts) == CLIENTS and all(window[0] <= n <= window[1] for n in counts)


def statuses_agree(a: admin_pb2.ClusterStatusReply, b: admin_pb2.ClusterStatusReply) -> list[str]:
    """The workers whose load report the two routers disagree on by more than one heartbeat."""
    theirs = {w.status.worker_id: w for w in b.workers}
    wrong = []
    for mine in a.workers:
        other = theirs[mine.status.worker_id]
        if not (mine.HasField("reported_load") and other.HasField("reported_load")):
            wrong.append(f"{mine.status.worker_id}: no report")
        elif abs(mine.load_report_seq - other.load_report_seq) > 1 or (
                mine.load_report_seq == other.load_report_seq and mine.reported_load != other.reported_load):
            wrong.append(f"{mine.status.worker_id}: #{mine.load_report_seq} {mine.reported_load} vs "
                         f"#{other.load_report_seq} {other.reported_load}")
    return wrong


def kill_router_1_with_streams_on_it(cluster, loop: ClosedLoop, timeout_s: float = 180.0) -> None:
    """SIGKILL router-1 at a moment when it serves a stream and every open stream has tokens."""
    replica = cluster.replica_info["router-1"]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if loop.all_streams_in(KILL_WINDOW) and cluster_status(replica["address"]).requests_in_flight:
            os.kill(replica["pid"], signal.SIGKILL)
            return
        time.sleep(0.01)
    raise AssertionError(f"router-1 never served a stream while all {CLIENTS} had tokens")


def test_two_routers_share_load_and_lose_one_without_losing_a_stream(cluster_2r, workload):
    prompts, params, expected = workload
    router_0, router_1 = cluster_2r.addresses.split(",")
    loop = ClosedLoop(cluster_2r.addresses, prompts, params)
    with cf.ThreadPoolExecutor(CLIENTS) as pool:
        clients = [pool.submit(loop.client, c) for c in range(CLIENTS)]
        deadline = time.monotonic() + 180
        while not loop.all_streams_in((1, STREAM_TOKENS)):
            assert time.monotonic() < deadline, "the clients' first streams got no token in 180 s"
            time.sleep(0.01)
        for _ in range(5):
            assert not statuses_agree(cluster_status(router_0), cluster_status(router_1))
        kill_router_1_with_streams_on_it(cluster_2r, loop)
        done = [d for c in clients for d in c.result(timeout=600)]
    assert sorted(i for i, *_ in done) == list(range(len(prompts)))
    for i, code, tokens, _ in done:
        assert code == "ok", (i, code)
        assert tokens == expected[i], i
    assert sum(resumes for *_, resumes in done) >= 1  # the stream(s) router-1 was serving
    wait_until_cluster_clean(cluster_2r, timeout_s=20)
    assert not audit_failures(worker_addresses(cluster_2r))
