"""A continued request (a migrated stream, engine/sequence.py): prompt + the tokens an earlier run
generated, handed to a fresh engine (or one that caches them), goes on exactly as the run would have.

Sampling draws by (seed, position) (engine/sampler.py), so this holds for seeded sampling as for
greedy; the text deltas, stop strings, max_tokens and usage carry over the break.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from pdserve.engine.llm_engine import InvalidRequestError, LLMEngine
from pdserve.engine.sequence import SamplingParams, Usage
from tests.conftest import assert_no_leaks, make_engine

PROMPT = list(range(1000, 1020))  # 20 tokens: one full block of 16 and a partial one
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, seed=3, max_tokens=40, ignore_eos=True)
FILTERED = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=11, max_tokens=40, ignore_eos=True)


@dataclass
class Run:
    """One request's outputs step by step."""

    tokens: list[int]
    deltas: list[str]  # one per token ("" where the text was held back)
    finish_reason: str | None
    usage: Usage

    @property
    def text(self) -> str:
        return "".join(self.deltas)


def run(engine: LLMEngine, sampling: SamplingParams, generated: tuple[int, ...] = (),
        prompt: list[int] = PROMPT) -> Run:
    rid = engine.add_request(prompt, sampling, generated=generated)
    out = Run([], [], None, Usage())
    while engine.has_unfinished():
        for o in engine.step():
            assert o.request_id == rid
            out.tokens += o.new_token_ids
            out.deltas.append(o.text_delta)
            out.finish_reason, out.usage = o.finish_reason, o.usage
    return out


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED, FILTERED], ids=["greedy", "seeded", "top_k_top_p"])
@pytest.mark.parametrize("cached", [False, True], ids=["fresh_engine", "prefix_cached"])
def test_a_continuation_draws_exactly_the_tokens_of_an_uninterrupted_run(tiny_loaded, sampling, cached):
    whole = run(make_engine(tiny_loaded), sampling)
    assert len(whole.tokens) == 40 and whole.finish_reason == "length"
    engine = make_engine(tiny_loaded)
    if cached:  # this engine has run the request before: prompt + output are in its prefix cache
        assert run(engine, sampling).tokens == whole.tokens
    rest = run(engine, sampling, generated=tuple(whole.tokens[:15]))
    assert rest.tokens == whole.tokens[15:]
    assert rest.deltas == whole.deltas[15:]  # the text goes on where the client's left off
    assert rest.finish_reason == "length"
    assert rest.usage.prompt_tokens == 20 and rest.usage.completion_tokens == 40
    # what it replayed at admission: prompt + 15 generated = 35 tokens, 2 full blocks of which cached
    assert (rest.usage.cached_tokens, rest.usage.computed_tokens) == ((32, 3) if cached else (0, 35))
    assert_no_leaks(engine)


def test_the_draws_depend_on_position_not_on_how_many_came_before(tiny_loaded):
    """Breaking at every point gives the same stream: no draw is consumed or skipped by a break."""
    whole = run(make_engine(tiny_loaded), replace(SEEDED, max_tokens=12))
    engine = make_engine(tiny_loaded, prefix_caching=False)
    for k in range(1, 12):
        assert run(engine, replace(SEEDED, max_tokens=12), generated=tuple(whole.tokens[:k])).tokens == \
            whole.tokens[k:], k
    assert_no_leaks(engine)


def test_a_break_inside_a_utf8_character_carries_the_held_bytes_in_the_next_delta(tiny_loaded):
    """The uninterrupted run held the text of token 34 back ("" delta: it ends inside a character);
    the continuation after it sends that text with its first delta, as the run did."""
    whole = run(make_engine(tiny_loaded), GREEDY)
    held = [i for i, (token, delta) in enumerate(zip(whole.tokens, whole.deltas, strict=True)) if not delta]
    assert held, "the test needs a token whose text is held back; pick another prompt"
    k = held[0] + 1
    engine = make_engine(tiny_loaded)
    rest = run(engine, GREEDY, generated=tuple(whole.tokens[:k]))
    assert rest.deltas == whole.deltas[k:]
    assert "".join(whole.deltas[:k]) + rest.text == whole.text
    assert_no_leaks(engine)


def test_a_stop_string_that_spans_the_break_is_caught(tiny_loaded):
    whole = run(make_engine(tiny_loaded), GREEDY)
    k = 15
    before = "".join(whole.deltas[:k])
    stop = whole.text[len(before) - 3:len(before) + 3]  # 3 characters each side of the break
    assert whole.text.find(stop) == len(before) - 3, "the stop string must first occur across the break"
    stopping = replace(GREEDY, stop=(stop,))
    uninterrupted = run(make_engine(tiny_loaded), stopping)
    assert uninterrupted.finish_reason == "stop" and len(uninterrupted.tokens) > k
    engine = make_engine(tiny_loaded)
    rest = run(engine, stopping, generated=tuple(whole.tokens[:k]))
    assert rest.finish_reason == "stop"
    assert rest.tokens == uninterrupted.tokens[k:]
    assert rest.deltas == uninterrupted.deltas[k:]  # the delta is cut where the uninterrupted run cut it
    assert stop not in before + rest.text[:-1]
    assert_no_leaks(engine)


def test_max_tokens_counts_the_generated_tokens(tiny_loaded):
    whole = run(make_engine(tiny_loaded), replace(GREEDY, max_tokens=10))
    engine = make_engine(tiny_loaded)
    rest = run(engine, replace(GREEDY, max_tokens=10), generated=tuple(whole.tokens[:9]))
    assert rest.tokens == whole.tokens[9:] and rest.finish_reason == "length"
    assert rest.usage.completion_tokens == 10
    assert_no_leaks(engine)


@pytest.mark.parametrize("generated, sampling, message", [
    ((7,) * 10, replace(GREEDY, max_tokens=10), "generated has 10 tokens and sampling.max_tokens is 10"),
    ((7, 49152), GREEDY, "generated token id 49152 is outside the vocabulary [0, 49152)"),
    ((7,) * 492, replace(GREEDY, max_tokens=500), "prompt (20 tokens) and generated (492) have 512 tokens; "
                                                  "this engine's context is 512"),
])
def test_a_continuation_that_cannot_go_on_is_refused_naming_the_field(tiny_loaded, generated, sampling,
                                                                      message):
    engine = make_engine(tiny_loaded)
    with pytest.raises(InvalidRequestError) as refused:
        engine.add_request(PROMPT, sampling, generated=generated)
    assert message in str(refused.value)
    assert_no_leaks(engine)
