"""The cache is exact: every cache path gives the tokens of a no-cache reference.

The reference recomputes the whole sequence densely (DecoderModel.reference_logits).
Greedy tokens must be identical; the logits of the final step must agree within
LOGIT_TOL max-abs: 1e-4 with a float32 cache. One dense causal pass over the
prompt and the engine's tokens gives every step's reference logits at once
(reference_rows): attention is causal, so row i is what a recompute of the
sequence up to i gives, and the engine's tokens are the reference's greedy tokens
exactly when each is the argmax of the row before it. A pass per step
(reference_greedy) computes the same rows n times over.

An int8 or fp8 cache is exact within its dtype: the reference attends over the
same quantized K/V (reference_logits(ids, kv_dtype)). Its logits get a looser
tolerance for a reason of their own: a batch of another shape moves a K/V value
by about 1e-6, and where that crosses a rounding boundary one code moves by a
whole step (int8: 1/255 of its rotated row's range), which the layers above
carry on. On the tiny model that moves logits by up to 2.3e-3 (measured over
288 prompt runs, none of whose tokens changed); on SmolLM2 by up to 0.24, and
the gap between the top two logits by up to 0.10, so there tokens are compared
where the reference's top two are further apart than that (test at the end).
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.kv_format import KV_FORMATS
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model import DECODE_GROUP_ROWS, AttentionMetadata, DecoderModel, sdpa_4d
from pdserve.engine.own_rows import with_own_rows
from pdserve.engine.sequence import SamplingParams
from tests.conftest import assert_no_leaks, make_engine

LOGIT_TOL = {"float32": 1e-4, "int8": 1e-2, "fp8": 1e-2}  # tiny model; why int8/fp8 differ: above
QUANTIZED = ["int8", "fp8"]
MAX_TOKENS = 8


def varied_prompts(vocab: int, block_size: int = 16) -> list[list[int]]:
    """8+ prompts, 1 token to more than 3 blocks, several sharing prefixes."""
    g = torch.Generator().manual_seed(1234)
    shared = torch.randint(0, vocab, (2 * block_size + 5,), generator=g).tolist()
    rand = lambda n: torch.randint(0, vocab, (n,), generator=g).tolist()  # noqa: E731
    return [
        rand(1),
        rand(7),
        rand(block_size),
        rand(block_size + 1),
        shared[:block_size] + rand(3),
        shared + rand(block_size * 2),  # > 3 blocks
        shared + rand(4),
        shared[: 2 * block_size],  # exactly 2 blocks, prefix of others
        rand(3 * block_size + 9),
        shared + rand(1),
    ]


def reference_greedy(engine: LLMEngine, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """Greedy continuation recomputing everything each step, K/V rounded as the engine's cache
    stores them; returns tokens and last-step logits."""
    ids = list(prompt)
    logits = None
    with torch.inference_mode():
        for _ in range(n):
            logits = engine.model.reference_logits(ids, engine.config.cache.kv_dtype)[-1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt):], logits


def reference_rows(engine: LLMEngine, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab]: row i is the reference's logits for the step that chose tokens[i], after the
    prompt and tokens[:i] (one causal pass over the prompt and tokens[:-1]; module docstring)."""
    with torch.inference_mode():
        logits = engine.model.reference_logits(prompt + tokens[:-1], engine.config.cache.kv_dtype)
    return logits[len(prompt) - 1:]


def capture_logits(engine: LLMEngine) -> dict[str, list[torch.Tensor]]:
    """Wrap the runner to keep every logits row of each request, in step order (test instrumentation)."""
    rows: dict[str, list[torch.Tensor]] = {}
    run = engine.runner.run

    def recording_run(chunks, on_layer_done=None):
        logits, sampled = run(chunks, on_layer_done)
        for row, chunk in zip(logits, sampled):
            rows.setdefault(chunk.seq.request_id, []).append(row.clone())
        return logits, sampled

    engine.runner.run = recording_run
    return rows


def check_against_reference(engine: LLMEngine, prompts: list[list[int]]) -> list:
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    rows = capture_logits(engine)
    results = engine.generate(prompts, greedy, detokenize=False)
    tolerance = LOGIT_TOL[engine.config.cache.kv_dtype]
    for prompt, result in zip(prompts, results):
        ref = reference_rows(engine, prompt, result.token_ids)
        assert result.token_ids == ref.argmax(-1).tolist(), f"prompt of {len(prompt)} tokens diverged"
        diff = (rows[result.request_id][-1] - ref[-1]).abs().max().item()
        assert diff <= tolerance, f"prompt of {len(prompt)} tokens: logits differ by {diff:.2e}"
    assert_no_leaks(engine)
    return results


@pytest.fixture(scope="module")
def prompts(tiny_loaded):
    return varied_prompts(tiny_loaded.config.vocab_size)


@pytest.mark.parametrize("kv_dtype", ["float32", *QUANTIZED])
def test_batched_paged_cache_matches_reference(tiny_loaded, prompts, kv_dtype):
    check_against_reference(make_engine(tiny_loaded, kv_dtype=kv_dtype), prompts)


@pytest.mark.parametrize("kv_dtype", ["float32", *QUANTIZED])
def test_prefix_hits_match_reference(tiny_loaded, prompts, kv_dtype):
    engine = make_engine(tiny_loaded, kv_dtype=kv_dtype)
    check_against_reference(engine, prompts)  # warms the cache
    results = check_against_reference(engine, prompts)  # same prompts again: prefix hits
    assert sum(r.usage.cached_tokens for r in results) > 0


@pytest.mark.parametrize("kv_dtype", ["float32", *QUANTIZED])
def test_chunked_prefill_under_small_budget_matches_reference(tiny_loaded, prompts, kv_dtype):
    check_against_reference(make_engine(tiny_loaded, budget=7, kv_dtype=kv_dtype), prompts)


@pytest.mark.parametrize("kv_dtype", ["float32", *QUANTIZED])
def test_forced_preemption_on_tiny_pool_matches_reference(tiny_loaded, prompts, kv_dtype):
    # 10 blocks of 8 tokens cannot hold all ten sequences at once: preemption must happen.
    engine = make_engine(tiny_loaded, block_size=8, num_blocks=10, budget=32, kv_dtype=kv_dtype)
    results = check_against_reference(engine, prompts)
    assert sum(r.usage.preemptions for r in results) > 0


@pytest.mark.parametrize("kv_dtype", ["float32", *QUANTIZED])
def test_no_prefix_caching_matches_reference(tiny_loaded, prompts, kv_dtype):
    check_against_reference(make_engine(tiny_loaded, prefix_caching=False, kv_dtype=kv_dtype), prompts)


@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16"])
def test_low_precision_cache_is_accepted_and_self_consistent(tiny_loaded, prompts, kv_dtype):
    """A float16/bfloat16 cache rounds K/V, so it is compared with itself: prefix hits and
    chunking must not change its tokens (the rounding is the same on every path)."""
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    plain = make_engine(tiny_loaded, kv_dtype=kv_dtype, prefix_caching=False)
    expected = [r.token_ids for r in plain.generate(prompts, greedy, detokenize=False)]
    cached = make_engine(tiny_loaded, kv_dtype=kv_dtype, budget=7)
    cached.generate(prompts, greedy, detokenize=False)
    again = [r.token_ids for r in cached.generate(prompts, greedy, detokenize=False)]
    assert again == expected
    assert_no_leaks(plain)
    assert_no_leaks(cached)


def test_smollm2_paths_match_reference(smollm_loaded):
    """The real model: prefix hits, chunked prefill and preemption together."""
    engine = make_engine(smollm_loaded, block_size=16, num_blocks=12, budget=40)
    prompts = varied_prompts(smollm_loaded.config.vocab_size)[:8]
    check_against_reference(engine, prompts)
    results = check_against_reference(engine, prompts)
    assert sum(r.usage.cached_tokens for r in results) > 0


# SmolLM2 with an int8 cache (module docstring): logits within 2x what was measured, and steps whose
# top two reference logits are closer than 2x the largest change of that gap measured are near-ties.
SMOLLM_INT8_LOGIT_TOL = 0.5
CLEAR_MARGIN = 0.2
# The test must not pass by finding near-ties everywhere: at least this many of its 2 x 8 x 8 steps
# are compared. A float32 or bfloat16 cache has 54 clear steps on these prompts (the near-ties are
# the model's); int8's first row format, whose larger error moved two of them, had 76; int8 with the
# own-row rule has 38: the 19-token prompt's first gap is 0.199 in its reference, just under the
# margin, so that prompt's 8 steps drop out of both runs (2026-12-06; every token still matched).
MIN_CLEAR_STEPS = 32


def check_clear_steps_against_reference(engine: LLMEngine, prompts: list[list[int]]) -> int:
    """Each request's tokens equal the reference's, step by step, until the reference's top two logits
    come within CLEAR_MARGIN (a near-tie, where either token is exact within the dtype); logits within
    SMOLLM_INT8_LOGIT_TOL at every step compared. Returns how many steps were compared."""
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    rows = capture_logits(engine)
    results = engine.generate(prompts, greedy, detokenize=False)
    compared = 0
    for prompt, result in zip(prompts, results):
        assert len(rows[result.request_id]) == len(result.token_ids)
        refs = reference_rows(engine, prompt, result.token_ids)
        for step, (token, row, ref) in enumerate(zip(result.token_ids, rows[result.request_id], refs)):
            diff = (row - ref).abs().max().item()
            assert diff <= SMOLLM_INT8_LOGIT_TOL, f"prompt of {len(prompt)}: logits differ by {diff:.3f}"
            top = torch.topk(ref, 2)
            if top.values[0] - top.values[1] < CLEAR_MARGIN:
                break
            assert token == int(top.indices[0]), f"prompt of {len(prompt)} tokens diverged at step {step}"
            compared += 1
    assert_no_leaks(engine)
    return compared


def test_smollm2_int8_paths_match_the_int8_reference(smollm_loaded):
    """The real model with an int8 cache, the same paths as test_smollm2_paths_match_reference:
    prefix hits, chunked prefill and preemption together."""
    engine = make_engine(smollm_loaded, block_size=16, num_blocks=12, budget=40, kv_dtype="int8")
    prompts = varied_prompts(smollm_loaded.config.vocab_size)[:8]
    compared = check_clear_steps_against_reference(engine, prompts)
    compared += check_clear_steps_against_reference(engine, prompts)  # again: prefix hits
    assert compared >= MIN_CLEAR_STEPS
    assert engine.pool.num_cached_blocks > 0


@pytest.mark.parametrize("kv_dtype", ["float32", *QUANTIZED])
def test_many_decode_rows_of_mixed_lengths_match_reference(tiny_loaded, kv_dtype):
    """More than DECODE_GROUP_ROWS sequences decode together at once, of lengths spread over
    several blocks, so decode attention runs group by group (each gathering only its own
    longest row's blocks) and must still give the reference's tokens and logits."""
    g = torch.Generator().manual_seed(99)
    lengths = [1, 70, 5, 33, 17, 64, 2, 48, 9, 81, 16, 40, 3, 57, 25, 12, 90, 7, 31, 44]
    assert len(lengths) > 2 * DECODE_GROUP_ROWS
    prompts = [torch.randint(0, tiny_loaded.config.vocab_size, (n,), generator=g).tolist() for n in lengths]
    check_against_reference(make_engine(tiny_loaded, kv_dtype=kv_dtype), prompts)


def test_decode_groups_sort_by_length_and_trim_padding():
    block_size = 4
    lens = torch.tensor([9, 1, 30, 2, 17, 5, 3, 8, 4, 6, 7, 2])  # 12 rows: a group of 8, then 4
    tables = torch.arange(12 * 8).view(12, 8)  # 8 blocks each: padded to the longest (30 tokens)
    meta = AttentionMetadata(torch.zeros(12, dtype=torch.long), torch.zeros(12, dtype=torch.long), 12,
                             tables, lens, ())
    groups = DecoderModel._decode_groups(meta, block_size)
    assert [g.rows.tolist() for g in groups] == [[1, 3, 11, 6, 8, 5, 9, 10], [7, 0, 4, 2]]
    assert [g.block_tables.shape[1] for g in groups] == [2, 8]  # 7 tokens need 2 blocks, 30 need 8
    assert torch.equal(groups[0].block_tables, tables[groups[0].rows, :2])
    assert groups[0].mask.shape == (8, 1, 1, 8)
    assert groups[0].mask[0, 0, 0].tolist() == [True] + [False] * 7  # row 1: one token of context


def test_an_int8_query_attends_its_own_row_in_float32(tiny_loaded):
    """An int8 query sees its own token's K/V as computed (KVFormat.own_row_in_float32): a one-token
    prompt, whose only key is its own, gets float32's logits through the engine's prefill; the first
    decode step, which also sees the prompt's stored int8 row, does not."""
    greedy = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    prompts = [[5], [17], [123]]
    first, second = {}, {}
    for kv_dtype in ("float32", "int8"):
        engine = make_engine(tiny_loaded, kv_dtype=kv_dtype)
        rows = capture_logits(engine)
        results = engine.generate(prompts, greedy, detokenize=False)
        first[kv_dtype] = torch.stack([rows[r.request_id][0] for r in results])
        second[kv_dtype] = torch.stack([rows[r.request_id][1] for r in results])
        assert_no_leaks(engine)
    assert (first["int8"] - first["float32"]).abs().max() <= 1e-5  # the rotation's rounding only
    assert (second["int8"] - second["float32"]).abs().max() > 1e-3


def test_int8_decode_attention_reads_each_rows_own_kv_in_float32(tiny_loaded):
    """The decode path against the rule, row by row: every stored row of the sequence as int8 gives
    it back, except the query's own, which attends as computed. 12 rows: two decode groups."""
    engine = make_engine(tiny_loaded, kv_dtype="int8")
    model, fmt, c = engine.model, KV_FORMATS["int8"], tiny_loaded.config
    g = torch.Generator().manual_seed(7)
    block_size, lens = 4, torch.tensor([1, 9, 3, 16, 5, 2, 12, 7, 4, 11, 6, 8])
    tables = torch.arange(len(lens) * 4).view(len(lens), 4)  # row i owns blocks 4i..4i+3
    k = torch.randn(2, len(lens), 16, c.num_kv_heads, c.head_dim, generator=g)  # K|V, row, position
    cache = fmt.store(k).view(2, -1, block_size, c.num_kv_heads, fmt.row_width(c.head_dim))
    own = tuple(fmt.rotate(k[j, torch.arange(len(lens)), lens - 1]) for j in (0, 1))
    q = torch.randn(len(lens), c.num_heads, c.head_dim, generator=g)
    unused_slots = torch.zeros(len(lens), dtype=torch.long)  # decode attention reads the tables only
    meta = AttentionMetadata(unused_slots, unused_slots, len(lens), tables, lens, ())
    groups = DecoderModel._decode_groups(meta, block_size)
    assert len(groups) == 2
    out = model._decode_attention(q, cache, fmt, meta, groups, own)
    for i, n in enumerate(lens.tolist()):
        stored = fmt.load_rotated(fmt.store(k[:, i, :n]))
        keys, values, mask = with_own_rows(stored[0], stored[1], (own[0][i:i + 1], own[1][i:i + 1]), n - 1)
        expected = sdpa_4d(q[i:i + 1], keys, values, mask, False, model.scale)
        assert (out[i] - expected[0]).abs().max() <= 1e-5, f"row {i}, context {n}"


def test_own_rows_come_after_the_stored_ones_and_each_query_sees_its_own():
    stored = torch.arange(5.0).view(5, 1, 1)  # positions 0..4 as stored
    own = (torch.full((2, 1, 1), -1.0), torch.full((2, 1, 1), -2.0))  # a chunk at positions 3, 4
    keys, values, mask = with_own_rows(stored, stored, own, start=3)
    assert keys.flatten().tolist() == [0, 1, 2, 3, 4, -1, -1]
    assert values.flatten().tolist() == [0, 1, 2, 3, 4, -2, -2]
    assert mask.tolist() == [[True, True, True, False, False, True, False],
                             [True, True, True, True, False, False, True]]


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_blocks_back_from_the_host_tier_match_reference(tiny_loaded, prompts, kv_dtype):
    # 12 blocks of 8 tokens hold a fraction of the prompts' blocks: the second pass finds most of
    # its prefixes in the host tier and loads them back (a copy), and must still be exact.
    engine = make_engine(tiny_loaded, block_size=8, num_blocks=12, budget=32, kv_dtype=kv_dtype,
                         host_blocks=64)
    check_against_reference(engine, prompts)
    results = check_against_reference(engine, prompts)
    assert sum(r.usage.host_cached_tokens for r in results) > 0
    assert all(r.usage.host_cached_tokens <= r.usage.cached_tokens for r in results)
