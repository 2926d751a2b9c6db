"""The outside oracle: our model against transformers' LlamaForCausalLM on the same weights.

Logits within 1e-4 max-abs (float32), greedy continuations identical, for the
tiny random model and for SmolLM2 (transformers reads the same GGUF file), on torch's own kernels
(TORCH_KERNELS: what transformers runs); the other kernels sum in other orders and are held to
transformers' greedy tokens in their own tests (tests/engine/test_linear_kernels.py and beside it).

Seeded sampling: our draws are counter-based (pdserve/engine/sampler.py: a uniform keyed by seed
and position, inverse transform), so no torch.Generator of transformers' generate(do_sample=True)
can reproduce them. What holds instead, and is checked: at every step the distribution we sample
from is the one transformers' own processors (temperature, top-k, top-p) make of its logits, and
the token we draw is the one that distribution gives for the same uniform draw.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.sampler import filtered_probs, inverse_cdf, uniform
from pdserve.engine.sequence import SamplingParams
from tests.conftest import TORCH_KERNELS, assert_no_leaks, make_engine

LOGIT_TOL = 1e-4
PROB_TOL = 1e-5  # float32 softmax over 49,152 logits that agree within LOGIT_TOL / temperature
CONTINUATION = 32


def hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([ids])).logits[0].float()


def hf_sampling_probs(hf_model, ids: list[int], p: SamplingParams) -> torch.Tensor:
    """transformers' next-token distribution for ids under p: its logits through its own
    temperature, top-k and top-p processors, in generate()'s order, then softmax."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    processors = LogitsProcessorList([TemperatureLogitsWarper(p.temperature), TopKLogitsWarper(p.top_k),
                                      TopPLogitsWarper(p.top_p)])
    logits = hf_logits(hf_model, ids)[-1:]
    return processors(torch.tensor([ids]), logits)[0].softmax(-1)


def hf_greedy(hf_model, ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                do_sample=False, max_new_tokens=n, pad_token_id=0)
    return out[0, len(ids):].tolist()


def paged_last_logits(engine, ids: list[int]) -> torch.Tensor:
    """Last-position logits from the engine's paged path (one prefill step)."""
    captured = {}
    run = engine.runner.run

    def recording_run(chunks, on_layer_done=None):
        logits, sampled = run(chunks, on_layer_done)
        captured["row"] = logits[-1].clone()
        return logits, sampled

    engine.runner.run = recording_run
    engine.generate([ids], SamplingParams(temperature=0, max_tokens=1), detokenize=False)
    engine.runner.run = run
    return captured["row"]


@pytest.fixture(scope="module")
def chat_ids(smollm_loaded):
    messages = [{"role": "user", "content": "Write one sentence about the sea."}]
    return smollm_loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def test_tiny_logits_match_transformers(tiny_loaded, hf_tiny):
    engine = make_engine(tiny_loaded, **TORCH_KERNELS)
    ids = torch.randint(0, tiny_loaded.config.vocab_size, (45,), generator=torch.Generator().manual_seed(3))
    ids = ids.tolist()
    theirs = hf_logits(hf_tiny, ids)
    with torch.inference_mode():
        ours_dense = engine.model.reference_logits(ids)
    assert (ours_dense - theirs).abs().max().item() <= LOGIT_TOL
    assert (paged_last_logits(engine, ids) - theirs[-1]).abs().max().item() <= LOGIT_TOL
    assert_no_leaks(engine)


def test_tiny_greedy_continuation_matches_transformers(tiny_loaded, hf_tiny):
    engine = make_engine(tiny_loaded, block_size=4, budget=16, **TORCH_KERNELS)  # chunked, many blocks
    ids = [5, 17, 300, 4000, 12, 7, 99, 1024, 33]
    [ours] = engine.generate([ids], SamplingParams(temperature=0, max_tokens=CONTINUATION), detokenize=False)
    assert ours.token_ids == hf_greedy(hf_tiny, ids, CONTINUATION)
    assert_no_leaks(engine)


def test_tiny_seeded_sampling_draws_what_transformers_distribution_gives_for_the_same_draw(tiny_loaded,
                                                                                             hf_tiny):
    engine = make_engine(tiny_loaded, **TORCH_KERNELS)
    p = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=21, max_tokens=24, ignore_eos=True)
    ids = [5, 17, 300, 4000, 12, 7, 99, 1024, 33]
    [ours] = engine.generate([ids], p, detokenize=False)
    assert len(set(ours.token_ids)) > 1  # a sampled stream, not a repeated token
    for step, token in enumerate(ours.token_ids):
        context = ids + ours.token_ids[:step]
        theirs = hf_sampling_probs(hf_tiny, context, p)
        with torch.inference_mode():
            mine = filtered_probs(engine.model.reference_logits(context)[-1], p)
        assert (mine - theirs).abs().max().item() <= PROB_TOL, step
        assert torch.equal(mine > 0, theirs > 0), step  # the same tokens kept by top-k and top-p
        assert inverse_cdf(theirs, uniform(p.seed, len(context))) == token, step
    assert_no_leaks(engine)


@pytest.mark.slow  # transformers' GGUF load
def test_smollm2_logits_match_transformers(smollm_loaded, hf_smollm, chat_ids):
    engine = make_engine(smollm_loaded, **TORCH_KERNELS)
    theirs = hf_logits(hf_smollm, chat_ids)
    with torch.inference_mode():
        ours_dense = engine.model.reference_logits(chat_ids)
    assert (ours_dense - theirs).abs().max().item() <= LOGIT_TOL
    assert (paged_last_logits(engine, chat_ids) - theirs[-1]).abs().max().item() <= LOGIT_TOL
    assert_no_leaks(engine)


@pytest.mark.slow  # transformers' GGUF load
def test_smollm2_greedy_continuation_matches_transformers(smollm_loaded, hf_smollm, chat_ids):
    engine = make_engine(smollm_loaded, **TORCH_KERNELS)
    [ours] = engine.generate([chat_ids], SamplingParams(temperature=0, max_tokens=CONTINUATION),
                             detokenize=False)
    theirs = hf_greedy(hf_smollm, chat_ids, CONTINUATION)
    assert ours.token_ids == theirs
    assert len(ours.token_ids) >= 8  # a real continuation, not an immediate end of turn
    assert_no_leaks(engine)
