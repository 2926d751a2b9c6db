"""Two real workers in one process, talking over real gRPC sockets (tiny model)."""

from __future__ import annotations

import time

import grpc
import pytest

from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.sequence import SamplingParams
from pdserve.worker.convert import sampling_to_proto
from pdserve.worker.server import WorkerConfig, WorkerServer
from protos.pdserve.v1 import kv_transfer_pb2_grpc, worker_pb2
from tests.conftest import make_engine
from tests.helpers.waiting import wait_for
from tests.helpers.workers import WorkerStubs, wait_until_clean, worker_server

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPT = list(range(400, 447))


@pytest.fixture(scope="module")
def workers(tiny_loaded):
    engine = EngineConfig(cache=CacheConfig(num_blocks=64), device="cpu")
    servers = [worker_server(WorkerConfig(role, engine), tiny_loaded) for role in ("prefill", "decode")]
    for s in servers:
        s.start()
    yield servers
    for s in servers:
        s.stop()


def stub(server: WorkerServer) -> WorkerStubs:
    return WorkerStubs(grpc.insecure_channel(server.address))


def decode_tokens(replies) -> tuple[list[int], list]:
    replies = list(replies)
    return [t for r in replies for t in r.token_ids], replies


def test_remote_prefill_then_decode_matches_one_engine(workers, tiny_loaded):
    prefill, decode = workers
    expected = make_engine(tiny_loaded).generate([PROMPT], GREEDY, detokenize=False)[0].token_ids
    reply = stub(prefill).Prefill(worker_pb2.PrefillRequest(
        request_id="a", prompt_token_ids=PROMPT, sampling=sampling_to_proto(GREEDY),
        decode_target=decode.address), timeout=30)
    assert reply.blocks_sent == 3 * tiny_loaded.config.num_layers and reply.usage.prompt_tokens == 47
    tokens, replies = decode_tokens(stub(decode).Decode(worker_pb2.DecodeRequest(
        request_id="a", prompt_token_ids=PROMPT, sampling=sampling_to_proto(GREEDY),
        first_token=reply.first_token), timeout=30))
    assert replies[0].used_transferred_kv and replies[-1].finished
    assert tokens == expected
    assert replies[-1].usage.completion_tokens == 10
    wait_until_clean(prefill, decode, timeout_s=0)


def test_prefill_here_matches_one_engine(workers, tiny_loaded):
    _, decode = workers
    expected = make_engine(tiny_loaded).generate([PROMPT], GREEDY, detokenize=False)[0].token_ids
    tokens, replies = decode_tokens(stub(decode).Decode(worker_pb2.DecodeRequest(
        request_id="b", prompt_token_ids=PROMPT, sampling=sampling_to_proto(GREEDY), prefill_here=True),
        timeout=30))
    assert tokens == expected and not replies[0].used_transferred_kv
    wait_until_clean(decode, timeout_s=0)


def test_status_counts_each_engine_step_with_work_and_its_time_as_the_histogram_does(workers):
    _, decode = workers
    status = lambda: stub(decode).Status(worker_pb2.StatusRequest(), timeout=10)  # noqa: E731
    histogram_sum = lambda: decode.metrics.registry.get_sample_value("pdserve_worker_step_seconds_sum")  # noqa: E731
    before, histogram_before = status(), histogram_sum()
    tokens, _ = decode_tokens(stub(decode).Decode(worker_pb2.DecodeRequest(
        request_id="steps", prompt_token_ids=PROMPT, sampling=sampling_to_proto(GREEDY), prefill_here=True),
        timeout=30))
    wait_until_clean(decode, timeout_s=5)
    after = status()
    # one step prefills the prompt and samples the first token, then one step a token
    assert after.steps_total - before.steps_total == len(tokens) == GREEDY.max_tokens
    seconds = after.step_seconds_total - before.step_seconds_total
    assert seconds > 0 and seconds == pytest.approx(histogram_sum() - histogram_before)


def test_steps_trace_what_each_step_computed_and_its_time_and_resume_after_a_number(workers):
    _, decode = workers
    steps = lambda after: stub(decode).Steps(worker_pb2.StepsRequest(after=after), timeout=10)  # noqa: E731
    before = stub(decode).Status(worker_pb2.StatusRequest(), timeout=10)
    assert steps(before.steps_total).steps == []
    prompt = list(range(900, 947))  # 47 tokens no other test sends: none of them cached
    sent = time.perf_counter()  # the workers run in this process: the same clock as their steps'
    decode_tokens(stub(decode).Decode(worker_pb2.DecodeRequest(
        request_id="trace", prompt_token_ids=prompt, sampling=sampling_to_proto(GREEDY), prefill_here=True),
        timeout=30))
    wait_until_clean(decode, timeout_s=5)
    after = stub(decode).Status(worker_pb2.StatusRequest(), timeout=10)
    reply = steps(before.steps_total)
    assert reply.steps_total == after.steps_total
    assert [r.number for r in reply.steps] == list(range(before.steps_total + 1, after.steps_total + 1))
    first, *rest = reply.steps
    assert (list(first.prefill_tokens), list(first.prefill_start), first.decode_seqs) == ([47], [0], 0)
    # then one token a step: the one sampled by the step before, attending to everything up to it
    assert [(r.decode_seqs, r.decode_context) for r in rest] == [(1, 48 + i) for i in range(9)]
    assert all(not r.prefill_tokens for r in rest)
    # the loop waited for the request, then went from step to step: each gap is its own time between
    assert not first.HasField("gap_seconds")
    assert all(r.HasField("gap_seconds") and 0 <= r.gap_seconds < 1 for r in rest)
    # each step starts where the one before ended plus the gap, on the machine's monotonic clock
    for before_it, step in zip(reply.steps, rest):
        assert step.started_at == pytest.approx(before_it.started_at + before_it.seconds + step.gap_seconds,
                                                abs=1e-3)
    assert sent <= first.started_at <= time.perf_counter()
    busy = after.step_seconds_total - before.step_seconds_total
    assert sum(r.seconds for r in reply.steps) == pytest.approx(busy)
    assert steps(reply.steps_total).steps == []


def test_bad_request_is_invalid_argument(workers):
    prefill, decode = workers
    with pytest.raises(grpc.RpcError) as err:
        list(stub(decode).Decode(worker_pb2.DecodeRequest(request_id="c", prompt_token_ids=[],
                                                          prefill_here=True), timeout=10))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "prompt is empty" in err.value.details()
    bad = sampling_to_proto(GREEDY)
    bad.top_p = 2.0
    with pytest.raises(grpc.RpcError) as err:
        stub(prefill).Prefill(worker_pb2.PrefillRequest(request_id="d", prompt_token_ids=[1, 2], sampling=bad,
                                                        decode_target=decode.address), timeout=10)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "top_p" in err.value.details()
    wait_until_clean(prefill, decode, timeout_s=0)


def decoding(decode: WorkerServer, request_id: str):
    """A Decode call of 400 tokens, prefilled on the worker, once its first reply is in."""
    call = stub(decode).Decode(worker_pb2.DecodeRequest(
        request_id=request_id, prompt_token_ids=PROMPT,
        sampling=sampling_to_proto(SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)),
        prefill_here=True), timeout=30)
    next(call)
    return call


def test_cancelled_decode_frees_blocks(workers):
    _, decode = workers
    decoding(decode, "e").cancel()
    wait_until_clean(decode)  # the abort reaches the engine loop a moment after the cancel


def test_a_call_that_ends_during_a_step_does_not_hold_up_the_workers_other_calls(workers):
    """gRPC runs a call's end callbacks on the server's one event thread. A callback that waited for
    the step in flight (the engine's lock) held up every call of the worker, new ones included, until
    the step ended: under load a request arriving then joined a step late (docs/simulator.md)."""
    _, decode = workers
    call = decoding(decode, "ends-mid-step")
    with decode.engine.lock:  # what a step holds while it runs
        call.cancel()
        assert wait_for(lambda: decode.loop.num_streams() == 0, timeout_s=5), "the call's end waited"
        status = stub(decode).Status(worker_pb2.StatusRequest(), timeout=5)  # a new call, answered
        assert status.worker_id == decode.config.worker_id
    wait_until_clean(decode)  # the abort reaches the engine at the loop's next turn


def test_a_new_call_with_an_id_whose_drop_is_pending_drops_the_old_request_first(tiny_loaded):
    """abort_later ends the stream at once and drops the request at the loop's next turn. A call that
    reuses the id before then (the router retries under the same id) drops the old request itself and
    goes on; the loop is not started until then here, so the drop is still pending."""
    from pdserve.worker.engine_loop import EngineLoop

    engine = make_engine(tiny_loaded)
    expected = make_engine(tiny_loaded).generate([PROMPT], GREEDY, detokenize=False)[0].token_ids
    loop = EngineLoop(engine)
    stream = loop.submit(PROMPT, GREEDY, "reused", detokenize=False)
    loop.abort_later("reused")
    assert [o.finish_reason for o in stream] == ["abort"] and loop.num_streams() == 0
    assert engine.has_unfinished()  # not dropped yet: no step ran, no lock was waited for
    again = loop.submit(PROMPT, GREEDY, "reused", detokenize=False)
    loop.start()
    outputs = list(again)
    assert outputs[-1].finish_reason == "length"
    assert [t for o in outputs for t in o.new_token_ids] == expected
    assert wait_for(lambda: not engine.has_unfinished(), timeout_s=5)
    assert engine.pool.num_used_blocks == 0
    loop.stop()


def test_a_worker_serves_only_its_own_roles_services(workers):
    """Prefill workers serve PrefillService; decode workers DecodeService and KVTransfer; both serve
    Worker (Status, Abort, Audit). Another role's method is UNIMPLEMENTED."""
    prefill, decode = workers
    decode_request = worker_pb2.DecodeRequest(request_id="wrong", prompt_token_ids=PROMPT, prefill_here=True)
    calls = {
        prefill: {"Decode": lambda: list(stub(prefill).Decode(decode_request, timeout=10)),
                  "Push": lambda: kv_transfer_pb2_grpc.KVTransferStub(grpc.insecure_channel(prefill.address))
                  .Push(iter(()), timeout=10)},
        decode: {"Prefill": lambda: stub(decode).Prefill(worker_pb2.PrefillRequest(
            request_id="wrong", prompt_token_ids=PROMPT, decode_target=decode.address), timeout=10)},
    }
    for worker, wrong in calls.items():
        assert stub(worker).Status(worker_pb2.StatusRequest(), timeout=10).role == worker.config.role
        for name, call in wrong.items():
            with pytest.raises(grpc.RpcError) as refused:
                call()
            assert refused.value.code() is grpc.StatusCode.UNIMPLEMENTED, (worker.config.role, name)
    wait_until_clean(prefill, decode, timeout_s=0)


def test_kv_channels_are_bounded_least_recently_used_closed_first(monkeypatch):
    import prefill_worker.channels as channels

    monkeypatch.setattr(channels, "MAX_DECODE_CHANNELS", 2)
    decode_channels = channels.DecodeChannels(lambda target: channels.GrpcKVChannel(target))
    first, second = decode_channels("127.0.0.1:1"), decode_channels("127.0.0.1:2")
    assert decode_channels("127.0.0.1:1") is first  # reused, and now the most recent
    decode_channels("127.0.0.1:3")

    assert decode_channels.addresses() == ["127.0.0.1:1", "127.0.0.1:3"]
    with pytest.raises(ValueError, match="[Cc]losed"):  # gRPC's words differ between call styles
        second.push(iter(()), timeout_s=1)
    decode_channels.close()


def test_status_says_which_kernels_the_engine_runs_and_why(workers):
    prefill, _ = workers
    status = stub(prefill).Status(worker_pb2.StatusRequest(), timeout=10)
    assert [(k.setting, k.kernel, k.reason) for k in status.kernels] == [
        (c.setting, c.kernel, c.reason) for c in prefill.engine.kernels.all()]
    assert [k.setting for k in status.kernels] == ["linear", "attention", "pointwise"]


def test_the_worker_logs_its_kernels_once_when_its_engine_loads(tiny_loaded, caplog):
    engine = EngineConfig(cache=CacheConfig(num_blocks=8), device="cpu", linear_kernel="matmul")
    with caplog.at_level("INFO", logger="pdserve.worker.server"):
        server = worker_server(WorkerConfig("decode", engine, worker_id="logged-0"), tiny_loaded)
    lines = [r.getMessage() for r in caplog.records if "kernels" in r.getMessage()]
    assert lines == [f"worker logged-0: kernels {server.engine.kernels.describe()}"]
    assert "linear matmul (set: linear_kernel matmul)" in lines[0]
