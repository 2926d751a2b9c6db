"""pdserve.client against an in-process Generation server (a test double of the router)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from pdserve.client import (
    AsyncPdserveClient,
    Completion,
    Delta,
    PdserveClient,
    PdserveError,
    RouterUnreachable,
    request_from,
)
from pdserve.engine.sequence import TokenLogprob
from protos.pdserve.v1 import generation_pb2 as pb
from protos.pdserve.v1 import generation_pb2_grpc as pb_grpc

DELTAS = [("Hello", [1]), (", ", [2]), ("world", [3])]
USAGE = {"prompt_tokens": 143, "cached_tokens": 128, "computed_tokens": 15, "completion_tokens": 3,
         "host_cached_tokens": 0, "disk_cached_tokens": 0}
TIMINGS = {"queue_ms": 1.5, "prefill_ms": 20.0, "transfer_ms": 0.0, "ttft_ms": 85.0}
WAIT_S = 5.0


class FakeGeneration(pb_grpc.GenerationServicer):
    """Streams DELTAS then a final message. Knobs: `gate` (wait on it before every message
    after the first), `fail_next` (abort the next call with (code, details) after
    `fail_after` messages), `send_final`. Like the router, it answers max_tokens < 1 with
    INVALID_ARGUMENT, and it sends logprobs when asked (_logprobs). It records requests and
    metadata, and whether a call was cancelled."""

    def __init__(self) -> None:
        self.requests: list[pb.GenerateRequest] = []
        self.metadata: list[dict[str, str]] = []
        self.gate: threading.Event | None = None
        self.fail_next: tuple[grpc.StatusCode, str] | None = None
        self.fail_after = 0
        self.send_final = True
        self.cancelled = threading.Event()
        self.finished = threading.Event()

    def Generate(self, request, context):  # noqa: N802 (the gRPC method name)
        self.requests.append(request)
        self.metadata.append(dict(context.invocation_metadata()))
        ended = threading.Event()  # set when this handler ends on its own (done or abort)
        # NOTE: after a cancel the sync server may never resume this generator, so the
        # cancel is observed in the termination callback, not by polling is_active().
        context.add_callback(lambda: ended.is_set() or self.cancelled.set())
        failure, self.fail_next = self.fail_next, None
        if request.sampling.HasField("max_tokens") and request.sampling.max_tokens < 1:
            ended.set()
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be >= 1")
        rid = request.request_id or f"req-{len(self.requests)}"
        for i, (text, ids) in enumerate(DELTAS):
            if failure and i == self.fail_after:
                ended.set()
                context.abort(*failure)
            if i > 0 and not self._wait_for_gate(context):
                return
            yield pb.GenerateResponse(request_id=rid, text=text, token_ids=ids,
                                      logprobs=_logprobs(request, ids))
        if self.send_final:
            yield pb.GenerateResponse(request_id=rid, finished=True, finish_reason="length",
                                      usage=pb.Usage(**USAGE), timings=pb.Timings(**TIMINGS),
                                      decode_worker="d0")
        ended.set()
        self.finished.set()

    def _wait_for_gate(self, context) -> bool:
        while self.gate is not None and not self.gate.wait(0.01):
            if not context.is_active():
                return False
        return True


LOGPROB = -0.5  # exact in float32


def _logprobs(request: pb.GenerateRequest, ids: list[int]) -> list[pb.TokenLogprob]:
    """Each token LOGPROB, and alternatives 0, 1, ... of sampling.logprobs, one less each."""
    if not request.sampling.HasField("logprobs"):
        return []
    top = [pb.TopLogprob(token_id=t, logprob=LOGPROB - t) for t in range(request.sampling.logprobs)]
    return [pb.TokenLogprob(token_id=t, logprob=LOGPROB, top=top) for t in ids]


@contextlib.contextmanager
def serving(fake: FakeGeneration) -> Iterator[str]:
    """Serve `fake` on a free loopback port; yields its HOST:PORT."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_GenerationServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(None)


def closed_port_target() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def fake() -> FakeGeneration:
    return FakeGeneration()


@pytest.fixture
def client(fake) -> Iterator[PdserveClient]:
    with serving(fake) as target, PdserveClient(target, timeout_s=10) as c:
        yield c


# --- sync ---------------------------------------------------------------------------------------

def test_stream_delivers_each_delta_before_the_server_finishes(client, fake):
    fake.gate = threading.Event()
    with client.stream("hi") as stream:
        deltas = stream.deltas()
        assert next(deltas) == Delta("Hello", [1])
        assert not fake.finished.is_set()  # the server is blocked on the gate
        fake.gate.set()
        assert list(deltas) == [Delta(", ", [2]), Delta("world", [3])]
        completion = stream.result()
    assert completion.text == "Hello, world" and fake.finished.is_set()


def test_generate_collects_the_completion(client):
    completion = client.generate("hi", request_id="r-7")
    assert completion == Completion(
        request_id="r-7", text="Hello, world", token_ids=[1, 2, 3], finish_reason="length",
        usage=USAGE, timings=TIMINGS, prefill_worker=None, decode_worker="d0")


def test_generate_collects_the_logprobs_it_asked_for(client, fake):
    completion = client.generate("hi", logprobs=2)
    assert fake.requests[-1].sampling.logprobs == 2
    top = ((0, LOGPROB), (1, LOGPROB - 1))
    assert completion.logprobs == [TokenLogprob(1, LOGPROB, top), TokenLogprob(2, LOGPROB, top),
                                   TokenLogprob(3, LOGPROB, top)]
    assert client.generate("hi").logprobs == []


def test_iterating_a_stream_yields_the_raw_messages(client):
    responses = list(client.stream(token_ids=[5, 6]))
    assert [r.text for r in responses] == ["Hello", ", ", "world", ""]
    assert responses[-1].finished and responses[-1].usage.cached_tokens == 128


def test_cancel_mid_stream_cancels_the_server_side_call(client, fake):
    fake.gate = threading.Event()
    stream = client.stream("hi")
    assert next(iter(stream)).text == "Hello"
    stream.cancel()
    assert fake.cancelled.wait(WAIT_S)
    assert list(stream) == []  # iteration ends quietly after our own cancel
    with pytest.raises(PdserveError, match="^CANCELLED: "):
        stream.result()
    assert not fake.finished.is_set()


def test_leaving_the_with_block_early_cancels(client, fake):
    fake.gate = threading.Event()
    with client.stream("hi") as stream:
        for _ in stream.deltas():
            break
    assert fake.cancelled.wait(WAIT_S)


def test_a_status_error_maps_to_pdserve_error_with_the_status_name(client):
    with pytest.raises(PdserveError) as info:
        client.generate("hi", max_tokens=0)
    assert info.value.code == "INVALID_ARGUMENT"
    assert info.value.message == "max_tokens must be >= 1"
    assert str(info.value) == "INVALID_ARGUMENT: max_tokens must be >= 1"


def test_an_error_mid_stream_comes_after_the_deltas_already_sent(client, fake):
    fake.fail_next, fake.fail_after = (grpc.StatusCode.RESOURCE_EXHAUSTED, "no free KV blocks"), 2
    received = []
    with pytest.raises(PdserveError, match="^RESOURCE_EXHAUSTED: no free KV blocks$"):
        for delta in client.stream("hi").deltas():
            received.append(delta.text)
    assert received == ["Hello", ", "]


def test_a_stream_that_ends_without_its_final_message_is_an_error(client, fake):
    fake.send_final = False
    with pytest.raises(PdserveError, match="^INTERNAL: the router ended the stream without"):
        client.generate("hi")


def test_the_deadline_bounds_the_whole_request(client, fake):
    fake.gate = threading.Event()
    with pytest.raises(PdserveError, match="^DEADLINE_EXCEEDED: .*0.3 s deadline"):
        client.generate("hi", timeout_s=0.3)
    assert fake.cancelled.wait(WAIT_S)


def test_an_unreachable_router_is_named_in_the_error():
    target = closed_port_target()
    with PdserveClient(target, timeout_s=5) as c, pytest.raises(RouterUnreachable) as info:
        c.generate("hi")
    assert str(info.value) == f"UNAVAILABLE: cannot reach the router at {target}; is `pdserve up` running?"
    assert info.value.code == "UNAVAILABLE" and "refused" in info.value.details.lower()


def test_metadata_goes_with_every_call(fake):
    with serving(fake) as target, PdserveClient(target, metadata=[("x-tenant", "t1")]) as c:
        c.generate("hi")
    assert fake.metadata[0]["x-tenant"] == "t1"


def test_bad_prompt_arguments_raise_before_any_call(client, fake):
    with pytest.raises(ValueError, match="exactly one of prompt, messages or token_ids"):
        client.generate("hi", token_ids=[1])
    assert fake.requests == []


# --- asyncio ------------------------------------------------------------------------------------

def test_async_stream_delivers_each_delta_before_the_server_finishes(fake):
    async def main(target):
        async with AsyncPdserveClient(target, timeout_s=10) as c:
            async with c.stream("hi") as stream:
                deltas = stream.deltas()
                assert await anext(deltas) == Delta("Hello", [1])
                assert not fake.finished.is_set()
                fake.gate.set()
                assert [d async for d in deltas] == [Delta(", ", [2]), Delta("world", [3])]
                return await stream.result()

    fake.gate = threading.Event()
    with serving(fake) as target:
        completion = asyncio.run(main(target))
    assert completion.text == "Hello, world" and completion.usage == USAGE


def test_async_generate_collects_and_maps_errors(fake):
    async def main(target):
        async with AsyncPdserveClient(target, timeout_s=10) as c:
            completion = await c.generate(messages=[{"role": "user", "content": "hi"}])
            with pytest.raises(PdserveError) as info:
                await c.generate("hi", max_tokens=0)
            return completion, info.value

    with serving(fake) as target:
        completion, error = asyncio.run(main(target))
    assert completion.token_ids == [1, 2, 3] and completion.decode_worker == "d0"
    assert str(error) == "INVALID_ARGUMENT: max_tokens must be >= 1"


def test_async_cancel_mid_stream_cancels_the_server_side_call(fake):
    async def main(target):
        async with AsyncPdserveClient(target, timeout_s=10) as c:
            stream = c.stream("hi")
            assert (await anext(aiter(stream))).text == "Hello"
            stream.cancel()
            assert [r async for r in stream] == []
            with pytest.raises(PdserveError, match="^CANCELLED: "):
                await stream.result()

    fake.gate = threading.Event()
    with serving(fake) as target:
        asyncio.run(main(target))
    assert fake.cancelled.wait(WAIT_S)


def test_async_unreachable_router():
    async def main(target):
        async with AsyncPdserveClient(target, timeout_s=5) as c:
            await c.generate("hi")

    with pytest.raises(RouterUnreachable, match="cannot reach the router"):
        asyncio.run(main(closed_port_target()))


# --- request_from -------------------------------------------------------------------------------

def test_request_from_sets_only_the_given_sampling_fields():
    s = request_from("hi", temperature=0, max_tokens=5).sampling
    assert s.HasField("temperature") and s.temperature == 0.0  # 0 (greedy) is not "unset"
    assert s.HasField("max_tokens") and s.max_tokens == 5
    assert not any(s.HasField(f) for f in ("top_k", "top_p", "seed", "logprobs"))
    assert list(s.stop) == [] and list(s.stop_token_ids) == [] and not s.ignore_eos


def test_request_from_fills_every_field():
    r = request_from(token_ids=[1, 2], request_id="abc", temperature=0.7, top_k=40, top_p=0.9, seed=3,
                     max_tokens=9, stop="\n\n", stop_token_ids=[2], ignore_eos=True, logprobs=0)
    assert r.WhichOneof("prompt") == "token_ids" and list(r.token_ids.ids) == [1, 2]
    assert r.request_id == "abc"
    s = r.sampling
    assert (s.top_k, s.seed, s.max_tokens, list(s.stop), list(s.stop_token_ids), s.ignore_eos) == (
        40, 3, 9, ["\n\n"], [2], True)
    assert s.HasField("logprobs") and s.logprobs == 0  # 0: the sampled token's logprob alone
    assert s.temperature == pytest.approx(0.7) and s.top_p == pytest.approx(0.9)


def test_request_from_prompt_kinds():
    text = request_from("hi", raw=True)
    assert text.WhichOneof("prompt") == "text" and text.text == "hi" and text.raw
    chat = request_from(messages=[{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
    assert [(m.role, m.content) for m in chat.chat.messages] == [("system", "s"), ("user", "u")]


@pytest.mark.parametrize("kwargs, message", [
    ({}, r"exactly one of prompt, messages or token_ids \(got: none\)"),
    ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, r"\(got: prompt, messages\)"),
    ({"messages": [{"role": "user", "content": "b"}], "raw": True}, "raw=True applies only to a text"),
    ({"messages": []}, "non-empty list"),
    ({"messages": [{"role": "robot", "content": "b"}]}, r"messages\[0\] must be"),
    ({"token_ids": [1, -1]}, r"token_ids\[1\] = -1 is not a token id"),
    ({"token_ids": [1], "stop_token_ids": [2**32]}, r"stop_token_ids\[0\]"),
    ({"prompt": 5}, "prompt must be a string, got int"),
])
def test_request_from_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        request_from(**kwargs)
