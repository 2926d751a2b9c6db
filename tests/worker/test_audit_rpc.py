"""Worker.Audit over real gRPC: two in-process workers (tiny model), KV moved between them by the
production Prefill/Decode path; a block corrupted on purpose is found, evicted, unpublished and
counted, and the next request is exact."""

from __future__ import annotations

import grpc
import pytest

from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.events import BlockRemoved
from pdserve.engine.hashing import hash_blocks
from pdserve.engine.sequence import SamplingParams
from pdserve.metrics import scrape
from pdserve.worker.convert import sampling_to_proto
from pdserve.worker.server import WorkerConfig, WorkerServer
from protos.pdserve.v1 import worker_pb2, worker_pb2_grpc
from tests.conftest import RecordingPublisher, make_engine
from tests.engine.test_audit import corrupt
from tests.helpers.kv_audit import audit_failures
from tests.helpers.workers import WorkerStubs, wait_until_clean, worker_server

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
PROMPT = list(range(500, 567))  # 67 tokens: 4 whole blocks, and decode fills a fifth


@pytest.fixture(scope="module")
def workers(tiny_loaded):
    engine = EngineConfig(cache=CacheConfig(num_blocks=64), device="cpu")
    published = RecordingPublisher()
    prefill = worker_server(WorkerConfig("prefill", engine), tiny_loaded)
    decode = worker_server(WorkerConfig("decode", engine), tiny_loaded, publisher=published)
    for s in (prefill, decode):
        s.start()
    yield prefill, decode, published
    for s in (prefill, decode):
        s.stop()


def stub(server: WorkerServer) -> worker_pb2_grpc.WorkerStub:
    return WorkerStubs(grpc.insecure_channel(server.address))


def remote_prefill_then_decode(prefill: WorkerServer, decode: WorkerServer, rid: str) -> list[int]:
    sampling = sampling_to_proto(GREEDY)
    reply = stub(prefill).Prefill(worker_pb2.PrefillRequest(
        request_id=rid, prompt_token_ids=PROMPT, sampling=sampling, decode_target=decode.address), timeout=30)
    replies = list(stub(decode).Decode(worker_pb2.DecodeRequest(
        request_id=rid, prompt_token_ids=PROMPT, sampling=sampling, first_token=reply.first_token),
        timeout=30))
    assert replies[0].used_transferred_kv
    return [t for r in replies for t in r.token_ids]


def audit(server: WorkerServer, sample: int = 0) -> worker_pb2.AuditReply:
    return stub(server).Audit(worker_pb2.AuditRequest(sample=sample), timeout=60)


def test_audit_over_grpc_finds_a_corrupt_received_block_and_the_next_request_is_exact(workers, tiny_loaded):
    prefill, decode, published = workers
    expected = make_engine(tiny_loaded).generate([PROMPT], GREEDY, detokenize=False)[0].token_ids
    assert remote_prefill_then_decode(prefill, decode, "a") == expected
    for server in (prefill, decode):  # transferred blocks are the prefill worker's bytes, verbatim
        clean = audit(server)
        assert clean.mismatched == 0 and clean.checked == clean.cached_blocks >= 4, clean
        assert clean.worker_id == server.config.worker_id and clean.complete and "bit-exact" in clean.rule

    hashes = hash_blocks(PROMPT, 16, decode.engine.salt)
    received = decode.engine.pool.match_prefix(hashes)
    with decode.engine.lock:
        corrupt(decode.engine, received[2], layer=1)
    published.events.clear()
    failures = audit_failures([prefill.address, decode.address])  # the helper every fault test ends with
    assert list(failures) == [decode.address]
    found = failures[decode.address]
    assert (found.mismatched, found.evicted, found.evicted_in_use) == (1, 1, 0), found
    assert published.events == [BlockRemoved(hashes[2], received[2])]  # what the index publisher ships
    status = decode.status()
    assert status.kv_audit_mismatches_total == status.kv_audit_evicted_total == 1
    m = scrape(f"http://{status.metrics_address}/metrics")
    assert m[("pdserve_worker_kv_audit_mismatches_total", ())] == 1
    assert m[("pdserve_worker_kv_audited_blocks_total", ())] == status.kv_audited_blocks_total >= 5

    replies = list(stub(decode).Decode(worker_pb2.DecodeRequest(
        request_id="b", prompt_token_ids=PROMPT, sampling=sampling_to_proto(GREEDY), prefill_here=True),
        timeout=30))
    assert [t for r in replies for t in r.token_ids] == expected
    assert replies[-1].usage.cached_tokens == 32  # blocks 0-1 still served, block 2 on recomputed
    assert audit(decode).mismatched == 0
    wait_until_clean(prefill, decode, timeout_s=0)


def test_a_sampled_audit_checks_fewer_blocks(workers):
    prefill, _, _ = workers
    whole = audit(prefill)
    some = audit(prefill, sample=1)
    assert 1 <= some.checked <= whole.checked and some.cached_blocks == whole.cached_blocks
