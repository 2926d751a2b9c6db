"""The sender's guarantees, on one engine (tiny model, no sockets): pinned blocks, abort over END,
and preemption of a request whose KV is being sent.

The end-to-end versions, through the production Prefill over every channel, are in
test_transfer_contract.py; these pin the mechanism itself, block by block.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from pdserve.engine.audit import KVAuditor
from pdserve.engine.hashing import hash_blocks
from pdserve.engine.sequence import SamplingParams
from pdserve.kvwire import KVLayout, LayerChunkHeader, TransferBegin, TransferEnd, decode_header
from pdserve.transfer.channel import Frame, PushResult
from pdserve.transfer.errors import FailureKind, TransferFailed
from prefill_worker.sender import LayerwiseSender
from tests.conftest import assert_no_leaks, make_engine

PROMPT = list(range(300, 350))  # 3 full blocks and a partial one
ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1)


class HeldChannel:
    """Takes BEGIN, then waits for go() before pulling (and so gathering) anything else."""

    def __init__(self) -> None:
        self.kinds: list[str] = []
        self.began = threading.Event()
        self._go = threading.Event()

    def go(self) -> None:
        self._go.set()

    def push(self, frames: Iterator[Frame], timeout_s: float) -> PushResult:
        for i, (header, _) in enumerate(frames):
            frame = decode_header(header)
            kind = {TransferBegin: "BEGIN", LayerChunkHeader: "LAYER", TransferEnd: "END"}[type(frame)]
            self.kinds.append(kind)
            if i == 0:
                self.began.set()
                self._go.wait(30)
        return PushResult("t", 0, 0)


def prefill_with(engine, sender, request_id: str, prompt: list[int], channel) -> tuple:
    """Start a transfer and compute the prompt to its first token, the sender observing each step."""
    transfer = sender.start(request_id, prompt, 0, channel, timeout_s=30)
    engine.add_request(prompt, ONE_TOKEN, request_id=request_id, detokenize=False)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step(sender)
    return transfer, outputs


def assert_cache_right(engine) -> None:
    """The KV audit (pdserve/engine/audit.py): every block the engine caches is its prompt's KV."""
    report = KVAuditor(engine).audit()
    assert report.complete and report.mismatched == 0, report


@pytest.fixture
def engine(tiny_loaded):
    engine = make_engine(tiny_loaded, num_blocks=16)
    yield engine
    assert_no_leaks(engine)
    assert_cache_right(engine)


def sender_of(engine) -> LayerwiseSender:
    return LayerwiseSender(engine, KVLayout.of_cache(engine.kv_cache, engine.fingerprint), max_chunk_bytes=1)


def test_offered_blocks_stay_pinned_until_the_transfer_lets_go(engine):
    sender, channel = sender_of(engine), HeldChannel()
    transfer, _ = prefill_with(engine, sender, "r", PROMPT, channel)
    full = engine.pool.match_prefix(hash_blocks(PROMPT, engine.block_size, engine.salt))
    layers = engine.model_config.num_layers
    assert len(full) == 3 and all(engine.pool.ref_count(b) == layers for b in full)  # once per layer
    assert transfer.pinned_blocks == 4 * layers  # the partial block too
    assert engine.pool.num_free_blocks == engine.pool.num_blocks - 4
    free = engine.pool.allocate(engine.pool.num_free_blocks)  # everything the pool can hand out
    assert not set(free) & set(full), "a block the sender must still read was handed out"
    engine.pool.release(free)
    transfer.close()
    channel.go()
    transfer.wait()
    sender.finish("r")
    assert all(engine.pool.ref_count(b) == 0 for b in full)


def test_abort_after_close_wins_over_end(engine):
    sender, channel = sender_of(engine), HeldChannel()
    transfer, _ = prefill_with(engine, sender, "r", PROMPT, channel)
    assert channel.began.wait(10)
    transfer.close()  # END is queued behind the LAYER work ...
    failure = transfer.abort()  # ... and the abort comes after it
    assert failure.kind is FailureKind.CANCELLED and transfer.pinned_blocks == 0
    channel.go()
    with pytest.raises(TransferFailed) as ended:
        transfer.wait()
    assert ended.value.kind is FailureKind.CANCELLED
    assert channel.kinds == ["BEGIN"], "a block was gathered, or END sent, after the abort"
    sender.finish("r")


def test_preempting_a_request_whose_kv_is_being_sent_aborts_the_transfer_and_drops_it(tiny_loaded):
    # 6 blocks, budget 17: the older request holds 2 blocks, the victim (80 tokens) takes one a
    # step and is preempted (the newest) when its 5th chunk finds the pool full.
    engine = make_engine(tiny_loaded, num_blocks=6, budget=17)
    sender = sender_of(engine)
    older_sampling = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine.add_request(list(range(900, 916)), older_sampling, request_id="older", detokenize=False)
    older_tokens = [t for _ in range(2) for out in engine.step(sender) for t in out.new_token_ids]
    victim = [(5 * j) % 300 + 1000 for j in range(80)]
    transfer = sender.start("victim", victim, 0, HeldChannel(), timeout_s=30)
    engine.add_request(victim, ONE_TOKEN, request_id="victim", detokenize=False)
    dropped = None
    while engine.has_unfinished():
        for out in engine.step(sender):
            if out.request_id == "victim":
                dropped = out
            else:
                older_tokens += out.new_token_ids
        if dropped is not None:
            assert transfer.pinned_blocks == 0, "the preemption left the victim's blocks pinned"
    assert dropped is not None and dropped.finished and dropped.finish_reason == "abort"
    assert dropped.new_token_ids == [] and dropped.usage.preemptions == 1
    failure = transfer.abort()  # what the Prefill call reports: the first reason stands
    assert failure.kind is FailureKind.ABORTED and "preempted" in failure.message
    reference = make_engine(tiny_loaded).generate([list(range(900, 916))], older_sampling, detokenize=False)
    assert older_tokens == reference[0].token_ids
    sender.finish("victim")
    assert_no_leaks(engine)
    assert_cache_right(engine)
