"""Usage accounting of prefix hits: cached = common prefix in whole blocks, never the whole prompt."""

from __future__ import annotations

import pytest

from pdserve.engine.llm_engine import InvalidRequestError
from pdserve.engine.sequence import SamplingParams
from tests.conftest import assert_no_leaks, make_engine

GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


def usage_of(engine, prompt: list[int]) -> tuple[int, int]:
    [result] = engine.generate([prompt], GREEDY, detokenize=False)
    return result.usage.cached_tokens, result.usage.computed_tokens


def test_textbook_case_block_size_1(tiny_loaded):
    engine = make_engine(tiny_loaded, block_size=1, num_blocks=256)
    turn1 = [1, 7, 7, 3, 9, 4, 2, 8]
    turn2 = turn1 + [5, 6, 3, 1, 2]
    edited = list(turn2)
    edited[2] = 0
    assert usage_of(engine, turn1) == (0, 8)
    assert usage_of(engine, turn2) == (8, 5)
    assert usage_of(engine, edited) == (2, 11)  # the edit at position 2 invalidates all after it
    assert_no_leaks(engine)


def test_trimming_from_the_front_reuses_nothing(tiny_loaded):
    engine = make_engine(tiny_loaded, block_size=1, num_blocks=256)
    history = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]
    usage_of(engine, history)
    assert usage_of(engine, history[1:]) == (0, 12)
    assert_no_leaks(engine)


def test_block_size_16_rounds_down_to_whole_blocks(tiny_loaded):
    engine = make_engine(tiny_loaded, block_size=16)
    base = list(range(100, 140))  # 40 tokens: 2 full blocks + 8
    usage_of(engine, base)
    assert usage_of(engine, base[:37] + [5, 5, 5]) == (32, 8)  # common prefix 37 -> 32
    assert usage_of(engine, base[:20] + [7] * 20) == (16, 24)  # common prefix 20 -> 16
    assert_no_leaks(engine)


def test_whole_prompt_cached_still_computes_the_last_token(tiny_loaded):
    engine = make_engine(tiny_loaded, block_size=16)
    prompt = list(range(200, 232))  # exactly 2 blocks
    usage_of(engine, prompt)
    assert usage_of(engine, prompt) == (16, 16)  # not 32: the last block holds the last token
    engine_bs1 = make_engine(tiny_loaded, block_size=1)
    usage_of(engine_bs1, prompt)
    assert usage_of(engine_bs1, prompt) == (31, 1)
    assert_no_leaks(engine)
    assert_no_leaks(engine_bs1)


def test_requests_with_different_cache_salts_share_no_prefix(tiny_loaded):
    engine = make_engine(tiny_loaded)
    prompt = list(range(100, 150))
    sampling = SamplingParams(temperature=0, max_tokens=2)

    def cached(salt: bytes) -> int:
        rid = engine.add_request(prompt, sampling, detokenize=False, cache_salt=salt)
        usage = None
        while engine.has_unfinished():
            usage = next((o.usage for o in engine.step() if o.request_id == rid and o.finished), usage)
        return usage.cached_tokens

    assert cached(b"a") == 0 and cached(b"a") == 48
    assert cached(b"b") == 0 and cached(b"") == 0 and cached(b"") == 48
    with pytest.raises(InvalidRequestError, match="cache_salt has 65 bytes; at most 64"):
        engine.add_request(prompt, sampling, cache_salt=b"x" * 65)
    assert_no_leaks(engine)
