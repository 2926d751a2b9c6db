"""Streams that lose their decode worker mid-stream go on on another one (router/service.py), in one
process over real gRPC sockets (tiny model: tests/helpers/cluster.py).

The victim decode worker holds every stream once it has sent HOLD_AT tokens (its debug fault plan,
decode_worker/faults.py), so each stream breaks at a known point, with no sleeps: the test reads
HOLD_AT tokens of every stream at the client, then stops or drains the victim.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from contextlib import contextmanager
from dataclasses import dataclass

import grpc
import pytest

from decode_worker.faults import DecodeFaultPlan
from decode_worker.role import DecodeConfig, DecodeRole
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.sequence import SamplingParams
from pdserve.worker.server import WorkerConfig, WorkerServer
from protos.pdserve.v1 import generation_pb2
from router.config import MigrationPolicy
from router.http.responses import extension_json
from tests.conftest import MIN_GREEDY_MARGIN, assert_no_leaks, greedy_margin, make_engine
from tests.helpers.cluster import running_cluster
from tests.helpers.workers import wait_until_clean, worker_info, worker_server

HOLD_AT = 10
MAX_TOKENS = 32
NUM_BLOCKS = 128


@dataclass(frozen=True)
class Case:
    prompt: list[int]
    sampling: SamplingParams

    def request(self, rid: str) -> generation_pb2.GenerateRequest:
        s = self.sampling
        sampling = generation_pb2.SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                                                 max_tokens=s.max_tokens, ignore_eos=s.ignore_eos,
                                                 stop=list(s.stop))
        if s.seed is not None:
            sampling.seed = s.seed
        return generation_pb2.GenerateRequest(request_id=rid, sampling=sampling,
                                              token_ids=generation_pb2.TokenIds(ids=self.prompt))


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
# 40-token prompts are prefilled remotely (32 uncached tokens or more), 12-token ones on the decode
# worker; so are their replays (prompt + 10 tokens), which covers both ways a migration resumes.
CASES = [Case(list(range(2000 + 100 * i, 2000 + 100 * i + n)), s)
         for i, (n, s) in enumerate([
             (40, GREEDY), (12, GREEDY),
             (40, SamplingParams(temperature=1.0, seed=5, max_tokens=MAX_TOKENS, ignore_eos=True)),
             (12, SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=6, max_tokens=MAX_TOKENS,
                                 ignore_eos=True))])]


@pytest.fixture(scope="module")
def expected(tiny_loaded):
    """What an uninterrupted run gives each case: one engine, each request alone."""
    engine = make_engine(tiny_loaded)
    for case in CASES:
        if case.sampling.greedy:  # batch shapes cannot flip a greedy token
            assert greedy_margin(engine, case.prompt, MAX_TOKENS) > MIN_GREEDY_MARGIN
    return [engine.generate([c.prompt], c.sampling)[0] for c in CASES]


def engine_config() -> EngineConfig:
    return EngineConfig(cache=CacheConfig(num_blocks=NUM_BLOCKS), device="cpu")


def decode_victim(loaded, hold: bool) -> WorkerServer:
    plan = DecodeFaultPlan(hold_after_tokens=HOLD_AT) if hold else None
    role = DecodeRole(DecodeConfig(fault_plan=plan))
    return WorkerServer(WorkerConfig("decode", engine_config(), worker_id="decode-victim"), role, loaded)


@contextmanager
def victim_cluster(loaded, hold: bool = True, **router_options):
    """A prefill worker and the victim (which holds its streams, unless hold is False) under a router;
    streams placed now go to the victim. Yields (cluster, victim, add_survivor): add_survivor() starts
    a second decode worker and lists it, so that a migration has somewhere to go."""
    victim = decode_victim(loaded, hold)
    survivor = worker_server(WorkerConfig("decode", engine_config(), worker_id="decode-survivor"), loaded)
    with running_cluster(loaded, workers=[WorkerConfig("prefill"), victim], num_blocks=NUM_BLOCKS,
                         **router_options) as cluster:
        def add_survivor() -> WorkerServer:
            survivor.start()
            cluster.records.append(worker_info(survivor))
            cluster.router.directory.refresh()
            return survivor
        try:
            yield cluster, victim, add_survivor
        finally:
            survivor.stop()


class Streams:
    """The cases' streams, read on threads of their own: the first HOLD_AT tokens, then the rest."""

    def __init__(self, cluster, pool: cf.ThreadPoolExecutor) -> None:
        self.calls = [cluster.stub.Generate(c.request(f"m{i}"), timeout=60) for i, c in enumerate(CASES)]
        self.replies: list[list[generation_pb2.GenerateResponse]] = [[] for _ in CASES]
        self.pool = pool

    def read_until_held(self) -> None:
        """Every stream has sent HOLD_AT tokens to the client (so the router relayed them)."""
        def first_tokens(i: int) -> None:
            while sum(len(r.token_ids) for r in self.replies[i]) < HOLD_AT:
                self.replies[i].append(next(self.calls[i]))
        list(self.pool.map(first_tokens, range(len(CASES))))

    def finish(self) -> list[list[generation_pb2.GenerateResponse]]:
        def rest(i: int) -> None:
            self.replies[i].extend(self.calls[i])
        list(self.pool.map(rest, range(len(CASES))))
        return self.replies


def migration_count(router, cause: str) -> float:
    samples = router.metrics.registry
    return samples.get_sample_value("pdserve_router_migrations_total", {"cause": cause}) or 0.0


def test_streams_whose_decode_worker_stops_mid_stream_go_on_elsewhere_token_for_token(tiny_loaded, expected):
    with victim_cluster(tiny_loaded) as (cluster, victim, add_survivor), cf.ThreadPoolExecutor(4) as pool:
        streams = Streams(cluster, pool)
        streams.read_until_held()
        assert len(victim.role.hold.wait_held(len(CASES), timeout_s=30)) == len(CASES)
        survivor = add_survivor()
        victim.stop()  # every held stream breaks after exactly HOLD_AT tokens
        replies = streams.finish()
        for case, want, got in zip(CASES, expected, replies, strict=True):
            last = got[-1]
            assert [t for r in got for t in r.token_ids] == want.token_ids
            assert "".join(r.text for r in got) == want.text  # the text deltas go on without a seam
            assert last.finished and last.finish_reason == "length"
            assert last.decode_worker == "decode-survivor"
            assert last.usage.prompt_tokens == len(case.prompt) and last.usage.completion_tokens == MAX_TOKENS
            [move] = last.migrations
            assert move.cause in ("CANCELLED", "UNAVAILABLE")
            assert (move.from_decode_worker, move.to_decode_worker) == ("decode-victim", "decode-survivor")
            assert move.after_tokens == HOLD_AT and move.replayed_tokens == len(case.prompt) + HOLD_AT
            assert move.gap_ms > 0
            assert extension_json(last)["migrations"][0]["after_tokens"] == HOLD_AT
        causes = {r[-1].migrations[0].cause for r in replies}
        assert sum(migration_count(cluster.router, c) for c in causes) == len(CASES)
        assert cluster.router.metrics.registry.get_sample_value(
            "pdserve_router_migration_gap_seconds_count") == len(CASES)
        wait_until_clean(cluster.prefill, survivor, timeout_s=5)
        assert_no_leaks(victim.engine)  # the stopped worker let go of every stream's blocks too
        assert cluster.router.servicer.requests_in_flight == 0


def test_a_drained_decode_worker_finishes_its_streams_in_place(tiny_loaded, expected):
    """Drain waits until every Decode call has sent its last reply (on the old code it returned as soon
    as the engine had finished, while replies were still to be sent, and the stop after it cut them)."""
    with victim_cluster(tiny_loaded) as (cluster, victim, add_survivor), cf.ThreadPoolExecutor(5) as pool:
        streams = Streams(cluster, pool)
        streams.read_until_held()
        victim.role.hold.wait_held(len(CASES), timeout_s=30)
        add_survivor()
        drained = pool.submit(victim.drain, 30.0)
        with pytest.raises(cf.TimeoutError):
            drained.result(timeout=1.0)  # every stream is still to send the client the rest
        victim.role.hold.release()
        replies = streams.finish()
        assert drained.result(timeout=30) is True
        for want, got in zip(expected, replies, strict=True):
            assert [t for r in got for t in r.token_ids] == want.token_ids
            assert got[-1].decode_worker == "decode-victim" and not got[-1].migrations
        assert migration_count(cluster.router, "CANCELLED") == 0
        assert migration_count(cluster.router, "UNAVAILABLE") == 0
        wait_until_clean(cluster.prefill, victim, timeout_s=5)


def test_a_drain_whose_grace_runs_out_is_cut_and_its_streams_move(tiny_loaded, expected):
    """The worker's streams are still held when its drain's grace is over; the stop after it (what
    the actor does on SIGTERM) cuts them, and the router moves each to the other decode worker."""
    with victim_cluster(tiny_loaded) as (cluster, victim, add_survivor), cf.ThreadPoolExecutor(4) as pool:
        streams = Streams(cluster, pool)
        streams.read_until_held()
        victim.role.hold.wait_held(len(CASES), timeout_s=30)
        add_survivor()
        assert victim.drain(0.2) is False  # the grace ran out with every stream still to finish
        victim.stop()
        replies = streams.finish()
        for want, got in zip(expected, replies, strict=True):
            assert [t for r in got for t in r.token_ids] == want.token_ids
            assert [m.from_decode_worker for m in got[-1].migrations] == ["decode-victim"]
        assert_no_leaks(victim.engine)


def test_a_stream_whose_decode_engine_fails_a_step_goes_on_elsewhere(tiny_loaded, expected, monkeypatch):
    """INTERNAL (the worker's engine failed a step, and it says so) after 11 tokens: the stream moves.
    The victim's 12th engine step waits until the survivor is listed, then raises."""
    case, want = CASES[1], expected[1]
    with victim_cluster(tiny_loaded, hold=False) as (cluster, victim, add_survivor):
        real_step, steps, go = victim.engine.step, [], threading.Event()

        def fail_the_12th(*args, **kwargs):
            steps.append(1)
            if len(steps) == HOLD_AT + 2:
                go.wait(30)
                raise RuntimeError("injected step failure")
            return real_step(*args, **kwargs)

        monkeypatch.setattr(victim.engine, "step", fail_the_12th)
        call = cluster.stub.Generate(case.request("fails"), timeout=60)
        replies = []
        while sum(len(r.token_ids) for r in replies) < HOLD_AT + 1:
            replies.append(next(call))
        add_survivor()
        go.set()
        replies.extend(call)
        assert [t for r in replies for t in r.token_ids] == want.token_ids
        [move] = replies[-1].migrations
        assert (move.cause, move.after_tokens, move.to_decode_worker) == ("INTERNAL", HOLD_AT + 1,
                                                                          "decode-survivor")
        assert migration_count(cluster.router, "INTERNAL") == 1
        wait_until_clean(victim, timeout_s=5)  # the victim keeps serving, clean


def test_with_migration_off_the_stream_ends_with_the_workers_status_naming_the_limit(tiny_loaded):
    case = CASES[1]
    with victim_cluster(tiny_loaded, migration=MigrationPolicy(limit=0)) as (cluster, victim, add_survivor):
        call = cluster.stub.Generate(case.request("off"), timeout=60)
        got = 0
        while got < HOLD_AT:
            got += len(next(call).token_ids)
        victim.role.hold.wait_held(1, timeout_s=30)
        add_survivor()
        threading.Thread(target=victim.stop, daemon=True).start()
        with pytest.raises(grpc.RpcError) as broke:
            list(call)
        assert broke.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
        assert "migration limit (--migration-limit 0)" in broke.value.details()
        assert f"after {HOLD_AT} tokens" in broke.value.details()
