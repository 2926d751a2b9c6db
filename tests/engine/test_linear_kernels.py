"""The opt-in oneDNN matmul kernel (EngineConfig.linear_kernel="onednn") under the exactness suite.

Against the no-cache reference on the same kernel: the suite's own assertions and 1e-4 tolerance
(tests/engine/test_exactness.py), every cache path. Against transformers, which runs MKL: greedy
tokens identical, and logits within ONEDNN_VS_TRANSFORMERS (oneDNN sums in another order; the
default matmul kernel meets test_oracle.py's 1e-4).
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.linear import MatmulLinear, OneDNNLinear, onednn_available, select_linear
from pdserve.engine.sequence import SamplingParams
from pdserve.field_error import FieldError
from tests.conftest import assert_no_leaks, make_engine
from tests.engine.test_exactness import check_against_reference, varied_prompts
from tests.engine.test_oracle import hf_greedy, hf_logits

# max-abs logits on the SmolLM2 chat prompt: 1.1e-4 measured; up to 5e-3 seen on random-id prompts
ONEDNN_VS_TRANSFORMERS = 1e-3

needs_onednn = pytest.mark.skipif(not onednn_available(torch.device("cpu")),
                                  reason="this torch build has no oneDNN linear on this CPU")


def onednn_engine(loaded, **kwargs):
    return make_engine(loaded, linear_kernel="onednn", **kwargs)


def test_kernel_names_are_checked():
    assert isinstance(select_linear(torch.device("cpu"), "matmul"), MatmulLinear)
    with pytest.raises(ValueError, match="use matmul or onednn"):
        select_linear(torch.device("cpu"), "mkl")
    with pytest.raises(FieldError, match="linear_kernel"):
        EngineConfig(linear_kernel="fast")


@needs_onednn
def test_onednn_computes_the_same_products_as_matmul():
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(14, 576, generator=g), torch.randn(960, 576, generator=g)
    ours = OneDNNLinear()(x, OneDNNLinear().prepare(w))
    assert torch.allclose(ours, MatmulLinear()(x, MatmulLinear().prepare(w)), atol=1e-4, rtol=1e-5)


@needs_onednn
@pytest.mark.parametrize("engine_kwargs",
                         [{}, {"budget": 7}, {"block_size": 8, "num_blocks": 10, "budget": 32}],
                         ids=["batched", "chunked", "preempted"])
def test_onednn_cache_paths_match_the_reference(tiny_loaded, engine_kwargs):
    prompts = varied_prompts(tiny_loaded.config.vocab_size)
    engine = onednn_engine(tiny_loaded, **engine_kwargs)
    check_against_reference(engine, prompts)
    results = check_against_reference(engine, prompts)  # again: prefix hits
    assert sum(r.usage.cached_tokens for r in results) > 0


@needs_onednn
def test_onednn_greedy_continuation_matches_transformers(tiny_loaded, hf_tiny):
    engine = onednn_engine(tiny_loaded, block_size=4, budget=16)
    ids = [5, 17, 300, 4000, 12, 7, 99, 1024, 33]
    [ours] = engine.generate([ids], SamplingParams(temperature=0, max_tokens=32), detokenize=False)
    assert ours.token_ids == hf_greedy(hf_tiny, ids, 32)
    assert_no_leaks(engine)


@needs_onednn
@pytest.mark.slow  # transformers' GGUF load
def test_onednn_smollm2_matches_transformers_within_its_bound(smollm_loaded, hf_smollm):
    messages = [{"role": "user", "content": "Write one sentence about the sea."}]
    chat_ids = smollm_loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    engine = onednn_engine(smollm_loaded, block_size=16, num_blocks=64, budget=40)
    with torch.inference_mode():
        diff = (engine.model.reference_logits(chat_ids) - hf_logits(hf_smollm, chat_ids)).abs().max().item()
    assert diff <= ONEDNN_VS_TRANSFORMERS
    [ours] = engine.generate([chat_ids], SamplingParams(temperature=0, max_tokens=24), detokenize=False)
    assert ours.token_ids == hf_greedy(hf_smollm, chat_ids, 24)
    check_against_reference(engine, varied_prompts(smollm_loaded.config.vocab_size)[:6])
