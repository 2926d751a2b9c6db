"""The KV audit (pdserve/engine/audit.py): every cache path audits clean, a corrupt block is
found, evicted and unpublished, and the next request is exact (tiny model; SmolLM2 where the
numbers are the point)."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine.audit import TOLERANCE, BlockVerdict, ComparisonRule, KVAuditor
from pdserve.engine.block_pool import Discarded
from pdserve.engine.events import BlockRemoved
from pdserve.engine.hashing import hash_blocks
from pdserve.engine.kv_format import KV_FORMATS
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sequence import SamplingParams
from tests.conftest import RecordingPublisher, assert_no_leaks, make_engine

BS = 16


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def random_prompts(vocab: int, seed: int, n: int, lo: int, hi: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def recording(engine: LLMEngine) -> RecordingPublisher:
    engine.publisher = RecordingPublisher()
    return engine.publisher


# --- each way a cached block comes to be --------------------------------------------------------

def one_by_one(loaded, kv_dtype):
    engine = make_engine(loaded, kv_dtype=kv_dtype)
    for p in random_prompts(loaded.config.vocab_size, 1, 4, 40, 90):
        engine.generate([p], greedy(1), detokenize=False)
    return engine


def chunked(loaded, kv_dtype):
    engine = make_engine(loaded, kv_dtype=kv_dtype, budget=23)
    engine.generate(random_prompts(loaded.config.vocab_size, 2, 4, 40, 90), greedy(1), detokenize=False)
    return engine


def batched(loaded, kv_dtype):
    engine = make_engine(loaded, kv_dtype=kv_dtype)
    engine.generate(random_prompts(loaded.config.vocab_size, 3, 6, 20, 90), greedy(1), detokenize=False)
    return engine


def chunks_and_decodes(loaded, kv_dtype):
    """Staggered arrivals: prefill chunks share steps with decode tokens; decode fills whole blocks."""
    engine = make_engine(loaded, kv_dtype=kv_dtype, budget=40)
    for p in random_prompts(loaded.config.vocab_size, 4, 5, 20, 70):
        engine.add_request(p, greedy(40), detokenize=False)
        for _ in range(3):
            engine.step()
    while engine.has_unfinished():
        engine.step()
    return engine


def after_prefix_hits(loaded, kv_dtype):
    engine = make_engine(loaded, kv_dtype=kv_dtype)
    shared = random_prompts(loaded.config.vocab_size, 5, 1, 37, 37)[0]
    engine.generate([shared], greedy(1), detokenize=False)
    for p in random_prompts(loaded.config.vocab_size, 6, 3, 20, 60):
        assert engine.generate([shared + p], greedy(1), detokenize=False)[0].usage.cached_tokens == 32
    return engine


def preempted(loaded, kv_dtype):
    engine = make_engine(loaded, kv_dtype=kv_dtype, num_blocks=14, budget=64)
    results = engine.generate(random_prompts(loaded.config.vocab_size, 7, 6, 20, 40), greedy(30),
                              detokenize=False)
    assert sum(r.usage.preemptions for r in results) > 0
    return engine


def back_from_the_host_tier(loaded, kv_dtype):
    """A 10-block pool over a host tier: the second pass loads its prefixes back from host memory."""
    engine = make_engine(loaded, kv_dtype=kv_dtype, num_blocks=10, host_blocks=32)
    prompts = random_prompts(loaded.config.vocab_size, 8, 8, 33, 40)
    for p in prompts:
        engine.generate([p], greedy(1), detokenize=False)
    again = [engine.generate([p], greedy(1), detokenize=False)[0] for p in prompts]
    assert sum(r.usage.host_cached_tokens for r in again) > 0
    return engine


PATHS = [one_by_one, chunked, batched, chunks_and_decodes, after_prefix_hits, preempted,
         back_from_the_host_tier]


def pool_state(engine: LLMEngine):
    pool = engine.pool
    return (pool.num_free_blocks, sorted(pool.cached_hashes()), list(pool._cached_lru), list(pool._free))


@pytest.mark.parametrize("kv_dtype", ["float32", "float16", "bfloat16", "int8", "fp8"])
@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.__name__)
def test_every_cache_path_audits_clean_and_the_audit_changes_nothing(tiny_loaded, path, kv_dtype):
    engine = path(tiny_loaded, kv_dtype)
    events = recording(engine)
    before = pool_state(engine)
    report = KVAuditor(engine).audit()
    assert report.mismatched == 0, report
    assert report.checked + report.skipped == report.cached_blocks == engine.pool.num_cached_blocks > 0
    assert report.max_rel_diff <= TOLERANCE[kv_dtype] / 4, report
    assert pool_state(engine) == before and events.events == []  # no block taken, no event
    assert_no_leaks(engine)


def test_smollm2_bit_exact_where_the_computation_repeats_else_well_within_the_tolerance(smollm_loaded):
    """The real model. A prompt of whole blocks prefilled alone in one chunk is exactly what the
    audit recomputes: bit-exact. Chunks, decode steps and prefix hits change GEMM shapes, and with
    them the last bits: the tolerance is needed, and the worst difference stays under a third of it."""
    vocab = smollm_loaded.config.vocab_size
    engine = make_engine(smollm_loaded, kv_dtype="bfloat16", budget=48)
    for p in random_prompts(vocab, 8, 2, 48, 48):  # 3 whole blocks each, one chunk each
        engine.generate([p], greedy(1), detokenize=False)
    report = KVAuditor(engine).audit()
    assert report.checked == report.exact == 6 and report.mismatched == 0, report

    shared = random_prompts(vocab, 9, 1, 40, 40)[0]
    engine.generate([shared], greedy(1), detokenize=False)
    for p in random_prompts(vocab, 10, 3, 30, 60):
        engine.add_request(shared + p, greedy(24), detokenize=False)
        engine.step()
    while engine.has_unfinished():
        engine.step()
    report = KVAuditor(engine).audit()
    assert report.mismatched == 0 and report.checked == report.cached_blocks >= 18, report
    assert report.exact < report.checked  # not bit-exact here
    assert report.max_rel_diff <= TOLERANCE["bfloat16"] / 3, report
    assert_no_leaks(engine)


# --- a corrupt block ----------------------------------------------------------------------------

def corrupt(engine: LLMEngine, block_id: int, layer: int = 0) -> None:
    """Flip one bit of one stored K value, as a bad memory cell or a bad copy would: the top exponent
    bit of a float, or of an int8/fp8 row's float32 scale."""
    row = engine.kv_cache[layer, 0, block_id, 0, 0]
    if KV_FORMATS[engine.config.cache.kv_dtype].scale_elements:
        element = row.view(torch.uint8)[-4:].view(torch.int32)
    else:
        bits = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
        element = row[:1].view(bits[engine.kv_cache.dtype])
    element ^= 1 << (30 if element.dtype == torch.int32 else 14)


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8", "fp8"])
def test_a_corrupted_block_is_found_evicted_and_unpublished_and_the_next_request_is_exact(
        tiny_loaded, kv_dtype):
    prompt = random_prompts(tiny_loaded.config.vocab_size, 11, 1, 60, 60)[0]  # 3 whole blocks
    follow_up = prompt + [5, 6, 7]
    expected = make_engine(tiny_loaded, kv_dtype=kv_dtype).generate([follow_up], greedy(8), detokenize=False)
    engine = make_engine(tiny_loaded, kv_dtype=kv_dtype)
    engine.generate([prompt], greedy(1), detokenize=False)
    hashes = hash_blocks(prompt, BS, engine.salt)
    victim = engine.pool.match_prefix(hashes)[1]
    corrupt(engine, victim, layer=1)
    events = recording(engine)

    auditor = KVAuditor(engine)
    report = auditor.audit()
    assert (report.checked, report.mismatched, report.evicted, report.evicted_in_use) == (3, 1, 1, 0)
    assert events.events == [BlockRemoved(hashes[1], victim)]
    assert engine.pool.match_prefix(hashes) == engine.pool.match_prefix(hashes[:1])  # the chain stops there
    totals = auditor.totals()
    assert (totals.audits, totals.checked, totals.mismatched, totals.evicted) == (1, 3, 1, 1)

    again = engine.generate([follow_up], greedy(8), detokenize=False)[0]
    assert again.token_ids == expected[0].token_ids
    assert again.usage.cached_tokens == BS  # block 0 still served; block 1 recomputed
    assert auditor.audit().mismatched == 0
    assert_no_leaks(engine)


def test_blocks_computed_on_top_of_a_corrupt_block_are_found_too(tiny_loaded):
    prompt = random_prompts(tiny_loaded.config.vocab_size, 12, 1, 32, 32)[0]  # 2 whole blocks
    longer = prompt + random_prompts(tiny_loaded.config.vocab_size, 13, 1, 40, 40)[0]  # 4 whole blocks
    expected = make_engine(tiny_loaded).generate([longer], greedy(8), detokenize=False)[0].token_ids
    engine = make_engine(tiny_loaded)
    engine.generate([prompt], greedy(1), detokenize=False)
    corrupt(engine, engine.pool.match_prefix(hash_blocks(prompt, BS, engine.salt))[0])
    wrong = engine.generate([longer], greedy(8), detokenize=False)[0]
    assert wrong.token_ids != expected and wrong.usage.cached_tokens == 32  # served from the bad block

    report = KVAuditor(engine).audit()
    assert (report.checked, report.mismatched, report.evicted) == (4, 3, 3)  # block 0 and blocks 2-3
    assert engine.generate([longer], greedy(8), detokenize=False)[0].token_ids == expected
    assert_no_leaks(engine)


def test_a_corrupt_block_in_use_is_unlisted_at_once_and_freed_when_released(tiny_loaded):
    prompt = random_prompts(tiny_loaded.config.vocab_size, 14, 1, 50, 50)[0]
    expected = make_engine(tiny_loaded).generate([prompt], greedy(4), detokenize=False)[0].token_ids
    engine = make_engine(tiny_loaded)
    engine.add_request(prompt, greedy(4), detokenize=False)
    engine.step()  # the prompt is computed and its blocks committed; the request is decoding
    hashes = hash_blocks(prompt, BS, engine.salt)
    victim = engine.pool.match_prefix(hashes)[2]
    assert engine.pool.ref_count(victim) == 1
    corrupt(engine, victim)
    events = recording(engine)

    report = KVAuditor(engine).audit()
    assert (report.mismatched, report.evicted, report.evicted_in_use) == (1, 1, 1)
    assert events.events == [BlockRemoved(hashes[2], victim)]
    assert len(engine.pool.match_prefix(hashes)) == 2 and engine.pool.ref_count(victim) == 1
    while engine.has_unfinished():  # the request holding it runs on, and lets go when it ends
        engine.step()
    assert victim not in engine.pool.cached_block_ids()  # FREE, not cached
    assert engine.generate([prompt], greedy(4), detokenize=False)[0].token_ids == expected
    assert_no_leaks(engine)


def test_a_block_reused_before_the_eviction_is_left_alone(tiny_loaded):
    """The audit compares a copy taken under the lock; when the engine evicts and reuses the block
    while the recompute runs, the mismatch is counted but the block, now another prefix's, stays."""
    a, b, c = random_prompts(tiny_loaded.config.vocab_size, 15, 3, 16, 16)  # one block each
    engine = make_engine(tiny_loaded, num_blocks=2)
    engine.generate([a], greedy(1), detokenize=False)
    engine.generate([b], greedy(1), detokenize=False)  # the pool is full of cached blocks, a's oldest
    [victim] = engine.pool.match_prefix(hash_blocks(a, BS, engine.salt))
    corrupt(engine, victim)
    auditor = KVAuditor(engine)
    recompute, moved_on = auditor.recompute, []

    def engine_moves_on(tokens, reuse=None):
        if tokens == a and not moved_on:  # a's bytes are copied: the engine now moves on
            moved_on.append(engine.generate([c], greedy(1), detokenize=False))  # evicts a's block, reuses it
        return recompute(tokens, reuse)

    auditor.recompute = engine_moves_on
    report = auditor.audit()
    assert moved_on and (report.checked, report.mismatched, report.evicted) == (2, 1, 0)
    assert engine.pool.match_prefix(hash_blocks(c, BS, engine.salt)) == [victim]  # c's block stays cached
    auditor.recompute = recompute
    assert auditor.audit().mismatched == 0
    assert_no_leaks(engine)


# --- what gets checked --------------------------------------------------------------------------

def test_a_sample_checks_its_targets_with_their_ancestors_once(tiny_loaded):
    engine = make_engine(tiny_loaded)
    a, b = random_prompts(tiny_loaded.config.vocab_size, 16, 2, 64, 64)  # 4 whole blocks each
    engine.generate([a, b], greedy(1), detokenize=False)
    report = KVAuditor(engine, rng=random.Random(0)).audit(sample=1)
    assert report.cached_blocks == 8 and report.checked in (1, 2, 3, 4)  # one target and its ancestors
    assert KVAuditor(engine).audit(sample=8).checked == 8
    assert KVAuditor(engine).audit(sample=100).checked == 8
    with pytest.raises(ValueError, match="sample must be >= 0"):
        KVAuditor(engine).audit(sample=-1)
    assert_no_leaks(engine)


def test_chains_that_share_a_prefix_recompute_it_once(tiny_loaded):
    vocab = tiny_loaded.config.vocab_size
    shared = random_prompts(vocab, 19, 1, 48, 48)[0]
    tails = random_prompts(vocab, 20, 5, 32, 32)
    engine = make_engine(tiny_loaded)
    engine.generate([shared + t for t in tails], greedy(1), detokenize=False)
    report = KVAuditor(engine).audit()
    assert (report.cached_blocks, report.checked, report.mismatched) == (3 + 5 * 2, 13, 0)
    assert report.recomputed_tokens == 48 + 5 * 32  # not 5 x 80
    assert_no_leaks(engine)


def test_a_block_whose_ancestor_was_evicted_is_skipped(tiny_loaded):
    prompt = random_prompts(tiny_loaded.config.vocab_size, 17, 1, 48, 48)[0]
    engine = make_engine(tiny_loaded)
    engine.generate([prompt], greedy(1), detokenize=False)
    hashes = hash_blocks(prompt, BS, engine.salt)
    root = engine.pool.match_prefix(hashes)[0]
    assert engine.discard_block(root, hashes[0]) is Discarded.EVICTED
    report = KVAuditor(engine).audit()
    assert (report.cached_blocks, report.checked, report.skipped, report.mismatched) == (2, 0, 2, 0)
    assert_no_leaks(engine)


def test_an_audit_stops_at_its_deadline_and_says_so(tiny_loaded):
    engine = make_engine(tiny_loaded)
    engine.generate(random_prompts(tiny_loaded.config.vocab_size, 18, 3, 40, 40), greedy(1), detokenize=False)
    report = KVAuditor(engine).audit(stop_at=0.0)
    assert not report.complete and report.checked == 0 and report.cached_blocks == 6
    assert_no_leaks(engine)


def test_the_rule_passes_rounding_noise_and_fails_a_difference_beyond_the_tolerance():
    rule = ComparisonRule.for_dtype("float32")
    block = torch.randn(2, 2, 16, 2, 8, generator=torch.Generator().manual_seed(0))
    scale = block[1, 0].abs().max()
    assert rule.compare(block, block.clone()).exact
    noisy = block.clone()
    noisy[1, 0, 3, 1, 2] += 0.5 * rule.tolerance * scale
    verdict = rule.compare(noisy, block)
    assert verdict.passed and not verdict.exact and 0 < verdict.max_rel_diff <= rule.tolerance
    noisy[1, 0, 3, 1, 2] += rule.tolerance * scale
    assert not rule.compare(noisy, block).passed
    for bad in (float("nan"), float("inf")):
        broken = block.clone()
        broken[0, 1, 0, 0, 0] = bad
        assert rule.compare(broken, block) == BlockVerdict(False, False, float("inf"), float("inf"))


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_a_quantized_rule_compares_values_as_the_model_reads_them(kv_dtype):
    """Codes times their scales are compared, not raw bytes: a code moved by one step passes (a
    last-bit difference upstream can do that), a value moved beyond the tolerance fails, and a scale
    whose exponent flipped to inf or NaN never passes."""
    rule, fmt = ComparisonRule.for_dtype(kv_dtype), KV_FORMATS[kv_dtype]
    values = torch.randn(2, 2, 16, 2, 8, generator=torch.Generator().manual_seed(0))
    block = fmt.store(values)
    assert rule.compare(block, block.clone()).exact
    one_step = fmt.store(values)
    codes = one_step.view(torch.uint8)[0, 1, 3, 1, :8]
    codes[2] += 1  # the next code up: one int8 step, or the next e4m3 value
    verdict = rule.compare(one_step, block)
    assert verdict.passed and not verdict.exact and 0 < verdict.max_rel_diff <= rule.tolerance
    far = values.clone()
    far[1, 0, 3, 1, 2] += 2 * rule.tolerance * values[1, 0].abs().max()
    assert not rule.compare(fmt.store(far), block).passed
    for bad in (float("inf"), float("nan")):
        broken = block.clone()
        broken.view(torch.uint8)[0, 0, 0, 0, -4:].view(torch.float32).fill_(bad)
        assert rule.compare(broken, block) == BlockVerdict(False, False, float("inf"), float("inf"))
