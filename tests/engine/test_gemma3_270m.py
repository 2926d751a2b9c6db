"""The second real model: Gemma 3 270M (its Q4_K_M GGUF, `make gemma3`) against transformers reading
the same file: the same greedy tokens, on torch's kernels and on the defaults, for a prompt longer
than its 512-token window so the local layers' window changes the answer's math."""

from __future__ import annotations

import os

import pytest
import torch

from pdserve.engine.sequence import SamplingParams
from tests.conftest import TORCH_KERNELS, assert_no_leaks, make_engine
from tests.engine.test_oracle import hf_greedy

pytestmark = pytest.mark.slow
TOKENS = 24


@pytest.fixture(scope="module")
def gemma_path() -> str:
    from pdserve.engine.named_models import MODELS

    try:
        return MODELS["gemma3-270m"].locate()
    except FileNotFoundError as e:
        pytest.skip(f"Gemma 3 270M is not installed: {e}")


@pytest.fixture(scope="module")
def gemma_loaded(gemma_path):
    from pdserve.engine.weights import load_model

    return load_model(gemma_path, progress=False)


@pytest.fixture(scope="module")
def hf_gemma(gemma_path):
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(gemma_path)
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()


def test_the_family_and_window_are_gemma_3s(gemma_loaded):
    c = gemma_loaded.config
    assert (c.architecture, c.head_dim, c.num_kv_heads, c.sliding_window) == ("gemma3", 256, 1, 512)
    assert len(c.sliding_layers) == 15 and 5 not in c.sliding_layers  # every 6th layer is global
    assert gemma_loaded.sampling_defaults.top_k == 64


@pytest.mark.parametrize("kernels", ["torch", "defaults"])
def test_greedy_tokens_match_transformers_past_the_window(gemma_loaded, hf_gemma, kernels):
    text = " ".join(f"Line {i}: the river runs to the sea." for i in range(60))  # > 512 tokens
    ids = gemma_loaded.tokenizer.encode(text + "\nSummary:", add_special_tokens=True)
    assert len(ids) > gemma_loaded.config.sliding_window
    engine = make_engine(gemma_loaded, budget=256, **(TORCH_KERNELS if kernels == "torch" else {}))
    [ours] = engine.generate([ids], SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True),
                             detokenize=False)
    assert ours.token_ids == hf_greedy(hf_gemma, ids, TOKENS)
    assert_no_leaks(engine)
