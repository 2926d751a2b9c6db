"""Token logprobs: log_softmax of the raw float32 logits the sampler received, for the requests
that ask, checked against the no-cache reference (DecoderModel.reference_logits) on SmolLM2, and
never changing a token of any request in the batch."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.engine.llm_engine import InvalidRequestError
from pdserve.engine.sampler import token_logprobs
from pdserve.engine.sequence import SamplingParams
from tests.conftest import MIN_GREEDY_MARGIN, assert_no_leaks, greedy_margin, make_engine

LOGPROB_TOL = 1e-4
TOP = 5


def greedy(logprobs: int | None, max_tokens: int = 6) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)


# --- the computation alone ----------------------------------------------------------------------

def test_top_is_sorted_of_the_asked_length_and_ties_go_to_the_lower_token_id():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0], [0.0, 0.0, 0.0, 0.0, 5.0]])
    asked, not_asked = SamplingParams(logprobs=4), SamplingParams()
    first, second = token_logprobs(logits, [2, 4], [asked, not_asked])
    reference = torch.log_softmax(logits[0], -1).tolist()
    assert second is None
    assert first.token_id == 2 and first.logprob == pytest.approx(reference[2], abs=1e-7)
    assert [token for token, _ in first.top] == [1, 2, 4, 3]
    assert [value for _, value in first.top] == pytest.approx([reference[i] for i in (1, 2, 4, 3)], abs=1e-7)
    [only_the_token] = token_logprobs(logits[1:], [0], [SamplingParams(logprobs=0)])
    assert only_the_token.top == ()
    assert only_the_token.logprob == pytest.approx(-5.0 - math.log1p(4 * math.exp(-5.0)), abs=1e-6)


def test_a_batch_nobody_asked_for_computes_nothing():
    logits = torch.full((2, 8), float("nan"))  # a softmax of these would be NaN; none is taken
    assert token_logprobs(logits, [0, 1], [SamplingParams(), SamplingParams()]) == [None, None]


def test_logprobs_must_be_non_negative_and_at_most_the_vocabulary(tiny_loaded):
    with pytest.raises(ValueError, match=r"logprobs must be >= 0 \(the number of top alternatives\), got -1"):
        SamplingParams(logprobs=-1)
    engine = make_engine(tiny_loaded, num_blocks=8)
    vocab = tiny_loaded.config.vocab_size
    with pytest.raises(InvalidRequestError, match=f"sampling.logprobs is {vocab + 1:,}; this engine's "
                                                  f"vocabulary has {vocab:,} tokens"):
        engine.add_request([1, 2, 3], SamplingParams(logprobs=vocab + 1))
    assert_no_leaks(engine)


# --- through the engine -------------------------------------------------------------------------

def test_smollm2_greedy_logprobs_match_a_log_softmax_of_the_reference_logits(smollm_loaded):
    """Each step: the sampled token is the reference's argmax, and its logprob and the top 5 are the
    log_softmax of the no-cache reference's logits for that step, within 1e-4."""
    engine = make_engine(smollm_loaded)
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours."}],
                                                  add_generation_prompt=True)
    [result] = engine.generate([prompt], greedy(TOP), detokenize=False)
    assert len(result.logprobs) == len(result.token_ids) == 6
    with torch.inference_mode():
        for step, (token, got) in enumerate(zip(result.token_ids, result.logprobs, strict=True)):
            logits = engine.model.reference_logits(prompt + result.token_ids[:step])[-1]
            reference = torch.log_softmax(logits, -1)
            assert token == int(reference.argmax()) == got.token_id
            assert abs(got.logprob - float(reference[token])) <= LOGPROB_TOL
            assert len(got.top) == TOP and got.top[0][0] == token
            values = [v for _, v in got.top]
            assert values == sorted(values, reverse=True)
            for alternative, value in got.top:
                assert abs(value - float(reference[alternative])) <= LOGPROB_TOL
    assert_no_leaks(engine)


def test_a_request_that_does_not_ask_gets_no_logprobs(tiny_loaded):
    engine = make_engine(tiny_loaded)
    engine.add_request([5, 6, 7], greedy(None, max_tokens=3), request_id="r")
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert [len(o.new_token_ids) for o in outputs] == [1, 1, 1]
    assert all(o.logprobs == [] for o in outputs)
    assert engine.generate([[5, 6, 7]], greedy(None, max_tokens=3), detokenize=False)[0].logprobs == []
    assert_no_leaks(engine)


def test_rows_that_ask_and_rows_that_do_not_share_a_batch_without_changing_a_token(tiny_loaded):
    prompts = [list(range(100, 120)), list(range(300, 305)), list(range(500, 540)), [7, 8, 9]]
    params = [greedy(3), greedy(None),
              SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=6, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.8, top_k=20, seed=12, max_tokens=6, ignore_eos=True)]
    probe = make_engine(tiny_loaded)
    assert all(greedy_margin(probe, p, 6) > MIN_GREEDY_MARGIN for p, s in zip(prompts, params) if s.greedy)
    alone = [make_engine(tiny_loaded).generate([p], s, detokenize=False)[0] for p, s in zip(prompts, params)]
    engine = make_engine(tiny_loaded)
    together = engine.generate(prompts, params, detokenize=False)
    for a, t, s in zip(alone, together, params, strict=True):
        assert t.token_ids == a.token_ids
        assert len(t.logprobs) == (len(t.token_ids) if s.logprobs is not None else 0)
        for x, y in zip(a.logprobs, t.logprobs, strict=True):
            # NOTE: the values, not the ids, of the alternatives: batching moves a logit by ~1e-6,
            # which may swap two alternatives closer than that; it cannot move a sorted value further
            assert x.token_id == y.token_id and abs(x.logprob - y.logprob) <= LOGPROB_TOL
            assert [v for _, v in y.top] == pytest.approx([v for _, v in x.top], abs=LOGPROB_TOL)
    assert_no_leaks(engine)
