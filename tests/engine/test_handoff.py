"""The KV hand-off state (pdserve/engine/handoff.py): reserve -> park -> claim | expire | drop,
exact block ids and hashes, and every flow ends with the pool clean. Most tests drive a KVHandoff
over a bare BlockPool (pure logic, no model); the last ones drive the engine that owns one."""

from __future__ import annotations

import threading

import pytest

from pdserve.engine.block_pool import BlockPool, NoFreeBlocksError
from pdserve.engine.events import BlockStored
from pdserve.engine.handoff import KVHandoff, TransferRejected
from pdserve.engine.hashing import engine_salt, hash_blocks, request_salt
from pdserve.engine.sequence import SamplingParams, TokenLogprob
from pdserve.engine.validation import EngineLimits, InvalidRequestError
from tests.conftest import assert_no_leaks, make_engine

BS = 4
PROMPT = list(range(1, 10))  # 9 tokens: 2 full blocks and a partial one
SALT = engine_salt("test-model", BS, "float32")
GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
ASKING = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2)
FIRST_LOGPROB = TokenLogprob(7, -0.25, ((7, -0.25), (3, -1.5)))  # what a prefill engine sends with token 7


class SignallingLock:
    """A re-entrant lock that announces each attempt to take it before it blocks."""

    def __init__(self) -> None:
        self.real, self.trying = threading.RLock(), threading.Event()

    def __enter__(self) -> None:
        self.trying.set()
        self.real.acquire()

    def __exit__(self, *exc) -> None:
        self.real.release()


class Rig:
    def __init__(self, num_blocks: int = 16, lock=None) -> None:
        self.pool = BlockPool(num_blocks, BS)
        self.in_flight: set[str] = set()
        self.events: list = []
        self.handoff = KVHandoff(self.pool, SALT, EngineLimits(vocab_size=100, max_model_len=64),
                                 lock or threading.RLock(), self.in_flight, self.publish)

    def publish(self) -> None:
        self.events += self.pool.drain_events()

    def assert_clean(self) -> None:
        assert self.pool.leaked_blocks() == []
        assert self.pool.num_free_blocks == self.pool.num_blocks
        assert self.handoff.num_parked() == 0


@pytest.fixture
def rig() -> Rig:
    return Rig()


def test_park_commits_the_full_blocks_chained_and_claim_hands_them_over(rig):
    r = rig.handoff.reserve("a", PROMPT, 0)
    assert r.block_ids == [0, 1, 2] and r.num_cached_blocks == 0
    assert not rig.handoff.is_parked("a") and rig.pool.num_cached_blocks == 0
    rig.handoff.park(r)
    assert rig.handoff.is_parked("a") and rig.handoff.num_parked() == 1
    h0, h1 = hash_blocks(PROMPT, BS, SALT)
    assert rig.events == [BlockStored(h0, None, (1, 2, 3, 4), 0), BlockStored(h1, h0, (5, 6, 7, 8), 1)]
    claimed = rig.handoff.claim("a", PROMPT, 7, GREEDY, b"")
    assert claimed is r and not rig.handoff.is_parked("a")
    assert rig.handoff.claim("a", PROMPT, 7, GREEDY, b"") is None  # claimed once only
    assert [rig.pool.ref_count(b) for b in r.block_ids] == [1, 1, 1]  # the claimer holds them now
    rig.handoff.release(claimed)
    rig.assert_clean()
    assert rig.pool.num_cached_blocks == 2  # the prompt's full blocks stay cached for reuse


def test_a_claimed_prefix_is_reused_and_one_no_longer_held_is_rejected(rig):
    rig.handoff.park(rig.handoff.reserve("a", PROMPT, 0))
    rig.handoff.drop("a")  # blocks 0 and 1 stay cached under the prompt's hashes
    r = rig.handoff.reserve("b", PROMPT, 2)
    assert r.block_ids[:2] == [0, 1] and r.num_cached_blocks == 2
    rig.handoff.release(r)
    other = [50, *PROMPT[1:]]  # the first block differs: nothing of it is cached
    with pytest.raises(TransferRejected, match="receiver holds 0 of the 1 prefix blocks"):
        rig.handoff.reserve("c", other, 1)
    with pytest.raises(TransferRejected, match=r"must be in \[0, 2\], got 3"):
        rig.handoff.reserve("c", PROMPT, 3)  # the last token's block is always computed
    rig.assert_clean()


def test_a_full_pool_refuses_and_lets_go_of_the_claimed_prefix():
    rig = Rig(num_blocks=3)
    rig.handoff.park(rig.handoff.reserve("a", PROMPT, 0))
    rig.handoff.drop("a")
    holder = rig.pool.allocate(1)  # 2 cached blocks + 1 in use: no room for a third block
    with pytest.raises(NoFreeBlocksError):
        rig.handoff.reserve("b", PROMPT, 2)
    assert [rig.pool.ref_count(b) for b in (0, 1)] == [0, 0]  # the prefix it acquired went back
    rig.pool.release(holder)
    rig.assert_clean()


def test_a_second_transfer_for_one_request_id_is_refused_and_leaks_nothing(rig):
    """Seen failing before the hand-off tracked in-flight reservations: the second transfer parked
    over the first, whose 3 blocks nobody could free any more."""
    first = rig.handoff.reserve("x", PROMPT, 0)
    with pytest.raises(InvalidRequestError, match="already has a KV transfer in flight"):
        rig.handoff.reserve("x", PROMPT, 0)
    rig.handoff.park(first)
    with pytest.raises(InvalidRequestError, match="already has a KV reservation"):
        rig.handoff.reserve("x", PROMPT, 0)
    assert rig.handoff.drop("x") and not rig.handoff.drop("x")
    rig.assert_clean()


def test_a_failed_transfer_releases_only_its_own_blocks(rig):
    failed = rig.handoff.reserve("x", PROMPT, 0)
    rig.handoff.release(failed)
    again = rig.handoff.reserve("x", PROMPT, 0)  # the id is free again
    rig.handoff.park(again)
    assert rig.handoff.is_parked("x")
    rig.handoff.drop("x")
    rig.assert_clean()


def test_drop_racing_the_expiry_sweep_frees_the_blocks_once():
    """A Decode call's drop (a gRPC thread) while the engine's step expires the same KV. Seen
    failing when drop read the parked KV before taking the lock: 'block 2 released more often than
    acquired', and with the blocks handed out again meanwhile, another request's blocks freed."""
    lock = SignallingLock()
    rig = Rig(lock=lock)
    rig.handoff.park(rig.handoff.reserve("r", PROMPT, 0, ttl_s=0.0))
    lock.real.acquire()  # the engine loop is mid-step
    lock.trying.clear()
    outcome: list = []
    dropper = threading.Thread(target=lambda: outcome.append(_call(rig.handoff.drop, "r")))
    dropper.start()
    assert lock.trying.wait(5)  # the drop waits for the lock
    rig.handoff.expire(float("inf"))  # the step's sweep frees it
    lock.real.release()
    dropper.join(5)
    assert outcome == [False]  # the sweep freed it; the drop found nothing left to free
    rig.assert_clean()


def _call(fn, *args):
    try:
        return fn(*args)
    except BaseException as e:  # the test asserts on what it raised
        return e


def test_expiry_frees_only_parked_kv_past_its_time(rig):
    old = rig.handoff.reserve("old", PROMPT, 0, ttl_s=1.0)
    rig.handoff.park(old)
    rig.handoff.park(rig.handoff.reserve("new", [9, *PROMPT[1:]], 0, ttl_s=1000.0))
    moving = rig.handoff.reserve("moving", [8, *PROMPT[1:]], 0, ttl_s=0.0)
    rig.handoff.expire(old.expires_at)
    assert not rig.handoff.is_parked("old") and rig.handoff.is_parked("new")
    assert [rig.pool.ref_count(b) for b in moving.block_ids] == [1, 1, 1]  # the receiver's to release
    rig.handoff.release(moving)
    rig.handoff.drop("new")
    rig.assert_clean()


@pytest.mark.parametrize("change, message", [
    (dict(prompt_token_ids=PROMPT[:-1]), "prompt_token_ids (8 tokens) differ"),
    (dict(cache_salt=b"tenant"), "cache_salt differs"),
    (dict(first_token=100), "first_token 100 is outside the vocabulary [0, 100)"),
    (dict(sampling=SamplingParams(stop_token_ids=(100,))), "sampling.stop_token_ids has 100"),
    (dict(prompt_token_ids=PROMPT[:-2], generated=tuple(PROMPT[-2:]), sampling=SamplingParams(max_tokens=2)),
     "generated has 2 tokens and sampling.max_tokens is 2: nothing is left to generate"),
    (dict(generated=(3,)), "prompt_token_ids + generated_token_ids (10 tokens) differ"),
    (dict(sampling=ASKING), "first_logprob is missing but sampling.logprobs is 2"),
    (dict(first_logprob=FIRST_LOGPROB), "first_logprob is given but sampling.logprobs is None"),
    (dict(sampling=ASKING, first_logprob=TokenLogprob(8, -0.25, FIRST_LOGPROB.top)),
     "first_logprob is for token 8, not first_token 7"),
    (dict(sampling=ASKING, first_logprob=TokenLogprob(7, -0.25, FIRST_LOGPROB.top[:1])),
     "first_logprob.top has 1 alternatives; sampling.logprobs asks for 2"),
    (dict(sampling=ASKING, first_logprob=TokenLogprob(7, -0.25, ((7, -0.25), (100, -1.5)))),
     "first_logprob token id 100 is outside the vocabulary [0, 100)"),
    (dict(sampling=ASKING, first_logprob=TokenLogprob(7, float("nan"), FIRST_LOGPROB.top)),
     "first_logprob of token 7 is nan; a logprob is <= 0"),
])
def test_a_refused_claim_frees_the_parked_kv(rig, change, message):
    rig.handoff.park(rig.handoff.reserve("a", PROMPT, 0))
    resume = dict(request_id="a", prompt_token_ids=PROMPT, first_token=7, sampling=GREEDY,
                  cache_salt=b"") | change
    with pytest.raises(InvalidRequestError) as refused:
        rig.handoff.claim(**resume)
    assert message in str(refused.value)
    assert not rig.handoff.is_parked("a")
    rig.assert_clean()


def test_neither_a_reservation_nor_a_claim_may_shadow_a_request_in_flight(rig):
    rig.handoff.park(rig.handoff.reserve("a", PROMPT, 0))
    rig.in_flight.add("a")  # the engine admitted a request under that id meanwhile
    with pytest.raises(InvalidRequestError, match="already in flight"):
        rig.handoff.reserve("a", PROMPT, 0)
    with pytest.raises(InvalidRequestError, match="already in flight"):
        rig.handoff.claim("a", PROMPT, 7, GREEDY, b"")
    rig.assert_clean()


def test_a_cache_salt_keys_the_committed_hashes(rig):
    rig.handoff.park(rig.handoff.reserve("a", PROMPT, 0, cache_salt=b"tenant"))
    tenant = hash_blocks(PROMPT, BS, request_salt(SALT, b"tenant"))
    assert rig.pool.match_prefix(tenant) == [0, 1]
    assert rig.pool.match_prefix(hash_blocks(PROMPT, BS, SALT)) == []  # no other tenant matches them
    rig.handoff.drop("a")
    rig.assert_clean()


def test_pins_keep_blocks_from_being_handed_out_until_unpinned(rig):
    blocks = rig.pool.allocate(2)
    rig.handoff.pin(blocks)
    rig.pool.release(blocks)  # the sequence that computed them let go; the sender still reads them
    assert rig.pool.num_free_blocks == rig.pool.num_blocks - 2
    rig.handoff.unpin(blocks)
    rig.assert_clean()


# --- through the engine that owns the hand-off -------------------------------------------------

def test_the_engine_resumes_parked_kv_into_its_batch(tiny_loaded):
    """The mechanics only: tests/transfer checks the tokens of a resumed transfer are exact."""
    engine = make_engine(tiny_loaded, block_size=BS, num_blocks=32)
    engine.generate([PROMPT], GREEDY, detokenize=False)  # caches the prompt's 2 full blocks
    engine.handoff.park(engine.handoff.reserve("t", PROMPT, 2))
    assert engine.load().parked_transfers == 1
    first = engine.resume_transferred("t", PROMPT, 7, GREEDY, detokenize=False)
    assert first.new_token_ids == [7] and not first.finished and first.usage.cached_tokens == 2 * BS
    assert (engine.load().running, engine.load().parked_transfers) == (1, 0)
    [out] = engine.step()  # decodes the next token straight away: no prefill
    assert out.request_id == "t" and len(out.new_token_ids) == 1 and out.usage.completion_tokens == 2
    assert engine.abort("t")
    assert_no_leaks(engine)


def test_a_resumed_request_emits_the_prefill_engines_first_logprob_then_its_own(tiny_loaded):
    """The first token's logits were on the prefill engine: its logprob comes with the resume."""
    engine = make_engine(tiny_loaded, block_size=BS, num_blocks=32)
    engine.handoff.park(engine.handoff.reserve("t", PROMPT, 0))
    first = engine.resume_transferred("t", PROMPT, 7, ASKING, detokenize=False, first_logprob=FIRST_LOGPROB)
    assert first.new_token_ids == [7] and first.logprobs == [FIRST_LOGPROB]
    [out] = engine.step()
    [logprob] = out.logprobs
    assert logprob.token_id == out.new_token_ids[0] and len(logprob.top) == 2
    assert engine.abort("t")
    assert_no_leaks(engine)


def test_a_resume_that_raises_half_way_leaves_nothing_held(tiny_loaded):
    engine = make_engine(tiny_loaded, block_size=BS, num_blocks=32)

    class BrokenTokenizer:
        def decode_after(self, prompt_ids, ids):
            raise RuntimeError("tokenizer broke")
    engine.tokenizer = BrokenTokenizer()  # the first token's text fails after the sequence joined
    engine.handoff.park(engine.handoff.reserve("t", PROMPT, 0))
    with pytest.raises(RuntimeError, match="tokenizer broke"):
        engine.resume_transferred("t", PROMPT, 7, GREEDY, detokenize=True)
    assert not engine.handoff.is_parked("t")
    assert_no_leaks(engine)


def test_abort_drops_parked_kv(tiny_loaded):
    engine = make_engine(tiny_loaded, block_size=BS, num_blocks=32)
    engine.handoff.park(engine.handoff.reserve("t", PROMPT, 0))
    assert engine.abort("t") and not engine.abort("t")
    assert_no_leaks(engine)


def test_abort_of_a_superseded_request_leaves_the_kv_a_newer_call_parked(tiny_loaded):
    """parked=False: what the engine loop uses when a retry under the same id supersedes a pending
    drop; the retry's transfer may already have parked KV under the id, which is the retry's."""
    engine = make_engine(tiny_loaded, block_size=BS, num_blocks=32)
    engine.handoff.park(engine.handoff.reserve("t", PROMPT, 0))
    assert not engine.abort("t", parked=False) and engine.handoff.is_parked("t")
    assert engine.abort("t") and not engine.handoff.is_parked("t")
    assert_no_leaks(engine)
