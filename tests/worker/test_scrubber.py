"""The background KV scrubber (pdserve/worker/scrubber.py): it stays within its share of wall time,
measured here independently of its own accounting, and it finds a corrupt block on its own."""

from __future__ import annotations

import time

import pytest

from pdserve.engine.audit import KVAuditor
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.hashing import hash_blocks
from pdserve.engine.sequence import SamplingParams
from pdserve.worker.convert import sampling_to_proto
from pdserve.worker.scrubber import AuditSchedule, AuditScrubber, NullScrubber
from pdserve.worker.server import WorkerConfig
from protos.pdserve.v1 import worker_pb2
from tests.conftest import assert_no_leaks, make_engine
from tests.engine.test_audit import corrupt, random_prompts
from tests.helpers.waiting import eventually
from tests.helpers.workers import worker_server
from tests.worker.test_audit_rpc import stub

GREEDY = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


@pytest.mark.parametrize("fraction", [0.05, 0.2])
def test_the_scrubber_spends_at_most_its_fraction_of_wall_time(tiny_loaded, fraction):
    engine = make_engine(tiny_loaded)
    engine.generate(random_prompts(tiny_loaded.config.vocab_size, 20, 8, 100, 200), GREEDY, detokenize=False)
    auditor = KVAuditor(engine)
    spans: list[tuple[float, float]] = []
    audit = auditor.audit

    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return audit(*args, **kwargs)
        finally:
            spans.append((started, time.perf_counter()))

    auditor.audit = timed
    # NOTE: an interval far below one audit's duration: without pacing it would audit ~100% of the time
    scrubber = AuditScrubber(auditor, interval_s=0.001, max_fraction=fraction)
    started = time.perf_counter()
    scrubber.start()
    eventually(lambda: len(spans) >= 8, 30)
    scrubber.stop()
    assert spans[0][1] - spans[0][0] > 0.001
    # every audit but the last has had its pause: over that window the share is bounded
    window = spans[-1][0] - started
    busy = sum(end - start for start, end in spans[:-1])
    assert busy <= fraction * window, f"{busy:.3f} s busy in {window:.3f} s"
    assert scrubber.rounds == len(spans) and auditor.totals().checked > 0
    assert_no_leaks(engine)


def test_a_worker_with_a_scrubber_finds_a_corrupt_block_on_its_own(tiny_loaded):
    config = EngineConfig(cache=CacheConfig(num_blocks=32), device="cpu")
    schedule = AuditSchedule(interval_s=0.01, max_fraction=0.5)
    worker = worker_server(WorkerConfig("decode", config, audit=schedule), tiny_loaded)
    assert isinstance(worker.scrubber, AuditScrubber)
    worker.start()
    try:
        prompt = list(range(700, 740))
        list(stub(worker).Decode(worker_pb2.DecodeRequest(
            request_id="s", prompt_token_ids=prompt, sampling=sampling_to_proto(GREEDY), prefill_here=True),
            timeout=30))
        eventually(lambda: worker.status().kv_audited_blocks_total >= 2, 30)  # it scrubs the clean cache
        assert worker.status().kv_audit_mismatches_total == 0
        [_, second] = worker.engine.pool.match_prefix(hash_blocks(prompt, 16, worker.engine.salt))
        with worker.engine.lock:
            corrupt(worker.engine, second)
        eventually(lambda: worker.status().kv_audit_mismatches_total == 1, 30)
        assert worker.status().kv_audit_evicted_total == 1
        assert worker.engine.pool.block_hash(second) is None
        status = worker.status()
        assert status.used_blocks == 0 and status.free_blocks == status.num_blocks
    finally:
        worker.stop()
    assert not worker.scrubber._thread.is_alive()


def test_the_scrubber_is_off_by_default_and_its_settings_are_checked(tiny_loaded):
    assert isinstance(worker_server(WorkerConfig("decode", EngineConfig(device="cpu", cache=CacheConfig(
        num_blocks=8))), tiny_loaded).scrubber, NullScrubber)
    with pytest.raises(ValueError, match="interval_s must be > 0 seconds"):
        AuditSchedule(interval_s=0)
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match=r"max_fraction must be in \(0, 1\]"):
            AuditSchedule(interval_s=1.0, max_fraction=bad)
