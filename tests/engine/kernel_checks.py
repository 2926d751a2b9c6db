"""The checks every kernel but torch's runs the engine through (tests/engine/test_linear_kernels.py,
test_attention_kernels.py, test_pointwise.py): its cache paths against the no-cache reference, blocks
filled by decode steps through the KV audit, and transformers' greedy tokens; and run_capped_to_avx2,
which runs a kernel check on the 8-lane build in a process of its own."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

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


def run_capped_to_avx2(code: str) -> None:
    """Runs `code` (which prints "checked" when its checks pass) with PDSERVE_CPU_ISA=avx2: the 8-lane
    build on an AVX-512 CPU too. The cap is read once per process, hence a process of its own."""
    env = {**os.environ, "PDSERVE_CPU_ISA": "avx2"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0 and "checked" in done.stdout, done.stderr[-2000:]


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
