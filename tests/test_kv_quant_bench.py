"""bench.kv_quant's arithmetic and its shipped text (the measurements themselves need SmolLM2 and
minutes: `python -m bench.kv_quant --quick` is the smoke run)."""

from __future__ import annotations

import argparse
import hashlib

import pytest

from bench.kv_quant import (
    PROMPTS,
    TEXT,
    Reference,
    agreement_figures,
    dtype_list,
    first_divergence,
    standard_error,
    targets_met,
)


def test_the_text_is_the_public_domain_chapter_its_readme_names_and_over_2000_tokens(tiny_loaded):
    data = TEXT.read_bytes()
    assert hashlib.sha256(data).hexdigest() in (TEXT.parent / "README.md").read_text()
    assert data.decode("utf-8").startswith("CHAPTER I.\nDown the Rabbit-Hole")
    assert len(tiny_loaded.tokenizer.encode(data.decode("utf-8"))) == 3026  # SmolLM2's tokenizer


def test_the_prompt_file_holds_160_distinct_prompts_one_a_line():
    assert len(set(PROMPTS)) == len(PROMPTS) >= 160
    assert all(p == p.strip() and "\n" not in p for p in PROMPTS)
    assert PROMPTS[:2] == ("What is the capital of France?", "Explain photosynthesis in simple terms.")


def test_agreement_counts_tokens_before_the_first_divergence():
    assert first_divergence([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert first_divergence([1, 2], [1, 2]) == 2
    ref = Reference(prompts=[[0], [0]], tokens=[[1, 2, 3, 4], [5, 6, 7, 8]], logits=[], perplexity=1.0,
                    capacity={})
    figures = agreement_figures("int8", [[1, 2, 9, 4], [5, 6, 7, 8]], ref)
    assert figures["int8_greedy_agreement"] == (2 + 4) / 8
    assert figures["int8_all_tokens_agree_fraction"] == 0.5
    assert figures["int8_greedy_agreement_positionwise"] == (3 / 4 + 1) / 2  # the 4 after the divergence
    assert figures["int8_first_divergences"] == [2, 4]


def test_targets_are_issue_18s():
    met = targets_met({"int8_perplexity_ratio": 1.0099, "int8_greedy_agreement": 0.89,
                       "int8_capacity_vs_float32": 3.76, "int8_capacity_vs_float16": 1.88})
    assert met == {"int8_perplexity_ratio_meets_target": True,
                   "int8_greedy_agreement_meets_target": False,
                   "int8_capacity_vs_float32_meets_target": True,
                   "int8_capacity_vs_float16_meets_target": True}


def test_dtypes_flag_takes_the_kv_dtypes_but_float32():
    assert dtype_list("int8,fp8") == ["int8", "fp8"]
    for bad in ("float32", "int4", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="give KV dtypes other than float32"):
            dtype_list(bad)


def test_agreement_carries_the_standard_error_of_its_mean_over_prompts():
    ref = Reference(prompts=[[0]] * 4, tokens=[[1, 2]] * 4, logits=[], perplexity=1.0, capacity={})
    figures = agreement_figures("int8", [[1, 2], [1, 9], [9, 9], [1, 2]], ref)
    per_prompt = [1.0, 0.5, 0.0, 1.0]                                   # mean 0.625
    variance = sum((a - 0.625) ** 2 for a in per_prompt) / 3            # 0.229166...
    assert figures["int8_greedy_agreement"] == 0.625
    assert figures["int8_greedy_agreement_stderr"] == pytest.approx((variance / 4) ** 0.5)   # 0.2394
    assert standard_error([0.7]) == 0.0
