"""The cache is exact: every cache path gives the tokens of a no-cache reference.

The reference recomputes the whole sequence densely at every step
(LlamaModel.reference_logits). Greedy tokens must be identical; the logits of
the final step must agree within 1e-4 max-abs with a float32 cache.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model import DECODE_GROUP_ROWS, AttentionMetadata, LlamaModel
from pdserve.engine.sequence import SamplingParams
from tests.conftest import assert_no_leaks, make_engine

LOGIT_TOL = 1e-4
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
    """Greedy continuation recomputing everything each step; returns tokens and last-step logits."""
    ids = list(prompt)
    logits = None
    with torch.inference_mode():
        for _ in range(n):
            logits = engine.model.reference_logits(ids)[-1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt):], logits


def capture_last_logits(engine: LLMEngine) -> dict[str, torch.Tensor]:
    """Wrap the runner to keep each request's most recent logits row (test instrumentation)."""
    last: dict[str, torch.Tensor] = {}
    run = engine.runner.run

    def recording_run(chunks, on_layer_done=None):
        logits, sampled = run(chunks, on_layer_done)
        for row, chunk in zip(logits, sampled):
            last[chunk.seq.request_id] = row.clone()
        return logits, sampled

    engine.runner.run = recording_run
    return last


def check_against_reference(engine: LLMEngine, prompts: list[list[int]]) -> list:
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    last = capture_last_logits(engine)
    results = engine.generate(prompts, greedy, detokenize=False)
    for prompt, result in zip(prompts, results):
        ref_tokens, ref_logits = reference_greedy(engine, prompt, MAX_TOKENS)
        assert result.token_ids == ref_tokens, f"prompt of {len(prompt)} tokens diverged"
        diff = (last[result.request_id] - ref_logits).abs().max().item()
        assert diff <= LOGIT_TOL, f"prompt of {len(prompt)} tokens: logits differ by {diff:.2e}"
    assert_no_leaks(engine)
    return results


@pytest.fixture(scope="module")
def prompts(tiny_loaded):
    return varied_prompts(tiny_loaded.config.vocab_size)


def test_batched_paged_cache_matches_reference(tiny_loaded, prompts):
    check_against_reference(make_engine(tiny_loaded), prompts)


def test_prefix_hits_match_reference(tiny_loaded, prompts):
    engine = make_engine(tiny_loaded)
    check_against_reference(engine, prompts)  # warms the cache
    results = check_against_reference(engine, prompts)  # same prompts again: prefix hits
    assert sum(r.usage.cached_tokens for r in results) > 0


def test_chunked_prefill_under_small_budget_matches_reference(tiny_loaded, prompts):
    check_against_reference(make_engine(tiny_loaded, budget=7), prompts)


def test_forced_preemption_on_tiny_pool_matches_reference(tiny_loaded, prompts):
    # 10 blocks of 8 tokens cannot hold all ten sequences at once: preemption must happen.
    engine = make_engine(tiny_loaded, block_size=8, num_blocks=10, budget=32)
    results = check_against_reference(engine, prompts)
    assert sum(r.usage.preemptions for r in results) > 0


def test_no_prefix_caching_matches_reference(tiny_loaded, prompts):
    check_against_reference(make_engine(tiny_loaded, prefix_caching=False), prompts)


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


def test_many_decode_rows_of_mixed_lengths_match_reference(tiny_loaded):
    """More than DECODE_GROUP_ROWS sequences decode together at once, of lengths spread over
    several blocks, so decode attention runs group by group (each gathering only its own
    longest row's blocks) and must still give the reference's tokens and logits."""
    g = torch.Generator().manual_seed(99)
    lengths = [1, 70, 5, 33, 17, 64, 2, 48, 9, 81, 16, 40, 3, 57, 25, 12, 90, 7, 31, 44]
    assert len(lengths) > 2 * DECODE_GROUP_ROWS
    prompts = [torch.randint(0, tiny_loaded.config.vocab_size, (n,), generator=g).tolist() for n in lengths]
    check_against_reference(make_engine(tiny_loaded), prompts)


def test_decode_groups_sort_by_length_and_trim_padding():
    block_size = 4
    lens = torch.tensor([9, 1, 30, 2, 17, 5, 3, 8, 4, 6, 7, 2])  # 12 rows: a group of 8, then 4
    tables = torch.arange(12 * 8).view(12, 8)  # 8 blocks each: padded to the longest (30 tokens)
    meta = AttentionMetadata(torch.zeros(12, dtype=torch.long), torch.zeros(12, dtype=torch.long), 12,
                             tables, lens, ())
    groups = LlamaModel._decode_groups(meta, block_size)
    assert [g.rows.tolist() for g in groups] == [[1, 3, 11, 6, 8, 5, 9, 10], [7, 0, 4, 2]]
    assert [g.block_tables.shape[1] for g in groups] == [2, 8]  # 7 tokens need 2 blocks, 30 need 8
    assert torch.equal(groups[0].block_tables, tables[groups[0].rows, :2])
    assert groups[0].mask.shape == (8, 1, 1, 8)
    assert groups[0].mask[0, 0, 0].tolist() == [True] + [False] * 7  # row 1: one token of context
