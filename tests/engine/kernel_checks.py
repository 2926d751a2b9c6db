"""The checks every opt-in kernel runs the engine through (tests/engine/test_linear_kernels.py,
test_attention_kernels.py, test_pointwise.py): its cache paths against the no-cache reference, blocks
filled by decode steps through the KV audit, and transformers' greedy tokens."""

from __future__ import annotations

import random

import pytest

from pdserve.engine import cpu_kernels
from pdserve.engine.audit import TOLERANCE, KVAuditor
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sequence import SamplingParams
from tests.conftest import assert_no_leaks
from tests.engine.test_exactness import check_against_reference, varied_prompts
from tests.engine.test_oracle import hf_greedy

needs_kernel = pytest.mark.skipif(cpu_kernels.unavailable() is not None,
                                  reason=f"pdserve's CPU kernels: {cpu_kernels.unavailable()}")


def check_cache_paths(engine: LLMEngine) -> None:
    """Every varied prompt against the reference, twice: the second time on prefix hits."""
    prompts = varied_prompts(engine.model_config.vocab_size)
    check_against_reference(engine, prompts)
    results = check_against_reference(engine, prompts)
    assert sum(r.usage.cached_tokens for r in results) > 0


def check_decode_filled_blocks_audit_clean(engine: LLMEngine) -> None:
    """Decode steps fill whole blocks beside prefill chunks; the KV audit recomputes each block as one
    prefill: the rows agree across the two paths."""
    rng = random.Random(11)
    for _ in range(4):
        prompt = [rng.randrange(engine.model_config.vocab_size) for _ in range(rng.randint(20, 60))]
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                           detokenize=False)
        for _ in range(3):
            engine.step()
    while engine.has_unfinished():
        engine.step()
    report = KVAuditor(engine).audit()
    assert report.mismatched == 0 and report.checked > 0, report
    assert report.max_rel_diff <= TOLERANCE["float32"] / 4, report
    assert_no_leaks(engine)


def check_greedy_matches_transformers(engine: LLMEngine, hf_model) -> None:
    ids = [5, 17, 300, 4000, 12, 7, 99, 1024, 33]
    [ours] = engine.generate([ids], SamplingParams(temperature=0, max_tokens=32), detokenize=False)
    assert ours.token_ids == hf_greedy(hf_model, ids, 32)
    assert_no_leaks(engine)
