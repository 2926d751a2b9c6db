"""The engine on Triton's paged attention (attention_kernel triton), as a CUDA worker runs it, here through
Triton's interpreter: the static decode step (padded buckets) and prefill chunks over the pool give the
no-cache reference's greedy tokens, for a float cache and for int8's rows with their own rows in float32.

Tolerances are test_exactness's: the kernels sum in another order than the reference's SDPA.
"""

from __future__ import annotations

import os

import pytest
import torch

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sequence import SamplingParams
from tests.conftest import assert_no_leaks
from tests.engine.test_exactness import capture_logits, reference_rows

LOGIT_TOL = {"float32": 1e-4, "bfloat16": 1e-2, "int8": 1e-2}
MAX_TOKENS = 4


@pytest.fixture(scope="module", autouse=True)
def triton_interpreter():
    """Triton's interpreter, which tests/conftest.py turns on for the session (it says why)."""
    pytest.importorskip("triton")
    assert os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8"])
def test_triton_attention_engine_matches_the_reference(tiny_loaded, kv_dtype):
    cache = CacheConfig(block_size=16, num_blocks=32, kv_dtype=kv_dtype)
    engine = LLMEngine(tiny_loaded, EngineConfig(cache=cache, scheduler=SchedulerConfig(budget_tokens(), 8),
                                                 device="cpu", attention_kernel="triton",
                                                 decode_step="static"))
    assert engine.kernels.attention.kernel == "triton" and engine.runner.static_decode is not None
    g = torch.Generator().manual_seed(3)
    vocab = tiny_loaded.config.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (1, 17, 40)]
    rows = capture_logits(engine)
    results = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                              detokenize=False)
    for prompt, result in zip(prompts, results):
        ref = reference_rows(engine, prompt, result.token_ids)
        assert result.token_ids == ref.argmax(-1).tolist(), f"prompt of {len(prompt)} tokens diverged"
        diff = (torch.stack(rows[result.request_id]) - ref).abs().max().item()
        assert diff <= LOGIT_TOL[kv_dtype], f"prompt of {len(prompt)} tokens: logits differ by {diff:.2e}"
    assert_no_leaks(engine)


def budget_tokens() -> int:
    """A prefill budget under the longest prompt, so one prompt is prefilled in two chunks (the second
    over a cached prefix in the pool)."""
    return 24
