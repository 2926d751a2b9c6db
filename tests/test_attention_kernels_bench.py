"""bench.attention_kernels compares the two attentions on the same rows: its cases and its measure(),
for decode rows and for a prefill chunk after cached rows."""

from __future__ import annotations

import random

import pytest
import torch

from bench.attention_kernels import LAYERS, Case, PrefillCase, measure
from pdserve.engine import cpu_kernels
from pdserve.engine.model import DecoderModel


@pytest.mark.skipif(cpu_kernels.unavailable() is not None, reason=f"{cpu_kernels.unavailable()}")
def test_both_kernels_attend_the_same_rows_and_agree(tiny_loaded):
    model = DecoderModel(tiny_loaded.config, tiny_loaded.state_dict, torch.device("cpu"))
    case = Case(model, 5, None, random.Random(3))
    assert len(case.layers) == LAYERS
    used = case.tables[case.tables > 0]
    assert len(used) == len(set(used.tolist())), "a block belongs to one row"
    result = measure(model, "decode", "5 rows", case, reps=1)
    assert result["rows"] == 5 and result["context_tokens"] == int(case.lens.sum())
    assert result["max_abs_diff"] < 1e-5
    assert result["sdpa_ms_per_layer"] > 0 and result["native_ms_per_layer"] > 0


@pytest.mark.skipif(cpu_kernels.unavailable() is not None, reason=f"{cpu_kernels.unavailable()}")
@pytest.mark.parametrize("cached, new", [(37, 9), (0, 20)])
def test_both_prefill_attentions_attend_the_same_chunk_and_agree(tiny_loaded, cached, new):
    model = DecoderModel(tiny_loaded.config, tiny_loaded.state_dict, torch.device("cpu"))
    case = PrefillCase(model, cached, new)
    assert len(case.table) == -(-(cached + new) // 16) == len(set(case.table.tolist()))
    result = measure(model, "prefill", f"{new} after {cached}", case, reps=1)
    assert result["rows"] == new and result["context_tokens"] == cached + new
    assert result["max_abs_diff"] < 1e-5
    assert result["native_gflop_per_s"] > 0 and result["sdpa_gflop_per_s"] > 0


@pytest.mark.skipif(cpu_kernels.unavailable() is not None, reason=f"{cpu_kernels.unavailable()}")
def test_the_prefill_kernels_two_paths_attend_the_same_chunk_to_the_bit(tiny_loaded):
    model = DecoderModel(tiny_loaded.config, tiny_loaded.state_dict, torch.device("cpu"))
    result = measure(model, "paths", "9 after 37", PrefillCase(model, 37, 9), reps=1)
    assert result["max_abs_diff"] == 0
    assert result["tiled_ms_per_layer"] > 0 and result["lanes_ms_per_layer"] > 0
    assert result["ratio"] == pytest.approx(result["tiled_ms_per_layer"] / result["lanes_ms_per_layer"])
