"""Sampling: seeds reproduce, draws are a function of (seed, position), filters behave, stop
conditions end requests. (A continued request drawing the tokens of an uninterrupted one:
tests/engine/test_continuation.py; the same distribution as transformers': tests/engine/test_oracle.py.)"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.sampler import filtered_probs, inverse_cdf, sample, uniform
from pdserve.engine.sequence import SamplingParams
from tests.conftest import assert_no_leaks, make_engine

PROMPT = [10, 20, 30, 40, 50]


def run(engine, sampling, prompts=(PROMPT,)):
    return [r.token_ids for r in engine.generate([list(p) for p in prompts], sampling, detokenize=False)]


def test_same_seed_same_output_regardless_of_batch_mates(tiny_loaded):
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
    alone = run(make_engine(tiny_loaded), p)[0]
    other = SamplingParams(temperature=1.0, seed=99, max_tokens=12, ignore_eos=True)
    engine = make_engine(tiny_loaded)
    crowded = engine.generate([PROMPT, [3, 4, 5], PROMPT], [other, other, p], detokenize=False)
    assert crowded[2].token_ids == alone
    assert run(make_engine(tiny_loaded), SamplingParams(temperature=1.0, seed=8, max_tokens=12,
                                                        ignore_eos=True))[0] != alone
    assert_no_leaks(engine)


@pytest.mark.parametrize("seed, position, draw", [
    (0, 0, 0.12311943861730146),
    (0, 1, 0.5826717794384204),
    (7, 100, 0.40216906306862643),
    (2**64 - 1, 2**64 - 1, 0.7640688705659031),
])
def test_the_draw_of_a_seed_and_position_is_pinned(seed, position, draw):
    """Known answers: a prefill worker and a decode worker (or two decode workers a stream moves
    between) must draw alike, whatever release each runs; a change here changes every seeded output."""
    assert uniform(seed, position) == draw


def test_inverse_cdf_follows_the_distribution_and_never_picks_a_token_without_mass():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.25, 0.25, 0.0])  # exact in binary: the boundaries are 0.5, 0.75
    assert inverse_cdf(probs, 0.0) == 1
    assert inverse_cdf(probs, 0.5 - 1e-9) == 1 and inverse_cdf(probs, 0.5) == 3
    assert inverse_cdf(probs * 3, 0.75) == 4  # a total other than 1 is scaled, not cut
    assert inverse_cdf(probs, 1 - 2**-53) == 4  # the largest draw: the last token with mass
    draws = [uniform(5, p) for p in range(20_000)]
    counts = torch.bincount(torch.tensor([inverse_cdf(probs, u) for u in draws]), minlength=6)
    frequencies = counts.double() / len(draws)
    assert counts[[0, 2, 5]].tolist() == [0, 0, 0]
    assert (frequencies - probs.double()).abs().max() < 0.015  # about 4 standard deviations at n = 20,000


def test_top_k_1_and_tiny_top_p_are_greedy(tiny_loaded):
    engine = make_engine(tiny_loaded)
    greedy = run(engine, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    top_k_1 = SamplingParams(temperature=1.5, top_k=1, seed=1, max_tokens=8, ignore_eos=True)
    assert run(engine, top_k_1) == greedy
    assert run(engine, SamplingParams(temperature=1.5, top_p=1e-6, seed=1, max_tokens=8,
                                      ignore_eos=True)) == greedy
    assert_no_leaks(engine)


def test_filtered_probs_keep_exactly_the_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = filtered_probs(logits, SamplingParams(temperature=1.0, top_p=0.8))
    assert (probs > 0).tolist() == [True, True, False, False]  # 0.5 + 0.3 reaches 0.8
    probs = filtered_probs(logits, SamplingParams(temperature=1.0, top_k=3))
    assert (probs > 0).tolist() == [True, True, True, False]
    torch.testing.assert_close(probs.sum(), torch.tensor(1.0))


def test_max_tokens_and_stop_token_ids(tiny_loaded):
    engine = make_engine(tiny_loaded)
    [full] = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                             detokenize=False)
    assert len(full.token_ids) == 6 and full.finish_reason == "length"
    stop_at = full.token_ids[2]
    [stopped] = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                         stop_token_ids=(stop_at,)), detokenize=False)
    assert stopped.token_ids == full.token_ids[: full.token_ids.index(stop_at) + 1]
    assert stopped.finish_reason == "stop"
    assert_no_leaks(engine)


def test_stop_string_truncates_text(smollm_loaded):
    engine = make_engine(smollm_loaded)
    ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Count from 1 to 10."}])
    [full] = engine.generate([ids], SamplingParams(temperature=0, max_tokens=40))
    assert "4" in full.text
    [stopped] = engine.generate([ids], SamplingParams(temperature=0, max_tokens=40, stop=("4",)))
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[: full.text.index("4")]
    assert_no_leaks(engine)


def test_a_greedy_row_takes_the_first_of_tied_maxima_as_argmax_does():
    logits = torch.full((3, 50), -1.0)
    logits[0, [7, 3, 40]] = 2.5
    logits[1, 49] = float("inf")
    logits[2, [0, 1]] = 0.0
    logits[2] = torch.where(logits[2] < 0, float("-inf"), logits[2])
    greedy = [SamplingParams(temperature=0)] * 3
    assert sample(logits, greedy, [0.0] * 3) == [3, 49, 0] == logits.argmax(dim=-1).tolist()
