"""Bad input raises an error naming the field and the limit; the engine keeps serving."""

from __future__ import annotations

import pytest

from pdserve.engine.llm_engine import InvalidRequestError
from pdserve.engine.sequence import SamplingParams
from pdserve.engine.weights import load_model
from tests.conftest import assert_no_leaks, make_engine

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture
def busy_engine(tiny_loaded):
    """An engine with one good request already in flight."""
    engine = make_engine(tiny_loaded)
    expected = make_engine(tiny_loaded).generate([[5, 6, 7]], GREEDY, detokenize=False)[0].token_ids
    rid = engine.add_request([5, 6, 7], GREEDY, request_id="good")
    engine.step()
    return engine, rid, expected


def finish_and_check(engine, rid, expected):
    tokens = []
    while engine.has_unfinished():
        tokens += [t for o in engine.step() if o.request_id == rid for t in o.new_token_ids]
    assert len(tokens) == 3  # the first token came from the step in the fixture
    assert expected[1:] == tokens
    assert_no_leaks(engine)


@pytest.mark.parametrize("prompt, match", [
    ([], "prompt is empty"),
    (list(range(600)), r"prompt has 600 tokens; this engine's context is 512"),
    ([1, 2, 10**6], r"token id 1000000 is outside the vocabulary \[0, 49152\)"),
    ([-1], r"token id -1 is outside the vocabulary"),
])
def test_bad_prompts_are_rejected_and_others_keep_going(busy_engine, prompt, match):
    engine, rid, expected = busy_engine
    with pytest.raises(InvalidRequestError, match=match):
        engine.add_request(prompt, GREEDY)
    finish_and_check(engine, rid, expected)


@pytest.mark.parametrize("kwargs, match", [
    ({"max_tokens": 0}, r"max_tokens must be >= 1, got 0"),
    ({"max_tokens": -3}, r"max_tokens must be >= 1, got -3"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
    ({"temperature": -0.1}, r"temperature must be >= 0 \(0 = greedy\), got -0.1"),
    ({"top_k": -1}, r"top_k must be >= 0"),
])
def test_bad_sampling_values_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_duplicate_request_id_is_rejected(busy_engine):
    engine, rid, expected = busy_engine
    with pytest.raises(InvalidRequestError, match="already in flight"):
        engine.add_request([1, 2], GREEDY, request_id=rid)
    finish_and_check(engine, rid, expected)


def test_unknown_model_path_names_the_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises((FileNotFoundError, ValueError), match="no-such-model"):
        load_model(str(missing), progress=False)


def test_abort_frees_blocks_at_once_in_any_state(tiny_loaded):
    engine = make_engine(tiny_loaded, block_size=4, budget=8)
    long_prompt = list(range(1, 30))
    engine.add_request(long_prompt, GREEDY, request_id="prefilling")
    engine.add_request([1, 2, 3], GREEDY, request_id="waiting")
    engine.step()  # "prefilling" is mid-prefill, "waiting" still queued
    assert engine.pool.num_used_blocks > 0
    assert engine.abort("prefilling") and engine.abort("waiting")
    assert not engine.abort("unknown")
    assert_no_leaks(engine)
