"""bench.kv_quant_window's variants: the masks, and that its dense pass is the engine model's
reference (every key in float: float32's logits; its own key in float: int8's)."""

import torch

from bench.kv_quant_window import fresh_mask, window_logits


def test_the_block_window_is_the_querys_own_block_and_a_count_is_the_last_positions():
    block = fresh_mask(40, "block")
    assert block[17, 16] and block[17, 17] and not block[17, 15] and not block[32, 31]
    last4 = fresh_mask(40, "4")
    assert last4[10, 7] and not last4[10, 6]


def test_a_window_over_everything_is_float32_and_int8_elsewhere_matches_the_int8_reference(tiny_loaded):
    from pdserve.engine.model import LlamaModel
    model = LlamaModel(tiny_loaded.config, tiny_loaded.state_dict, torch.device("cpu"))
    ids = list(range(3, 43))
    all_fresh = window_logits(model, ids, str(len(ids)))
    torch.testing.assert_close(all_fresh, model.reference_logits(ids, "float32"), rtol=1e-4, atol=1e-4)
    reference = model.reference_logits(ids, "int8")
    own_row = window_logits(model, ids, "1")  # its own key and value in float: today's int8
    # NOTE: dense einsums against SDPA sum in another order, and where that crosses a rounding boundary
    # an int8 code moves a whole step: 1e-2, the tiny model's int8 tolerance in test_exactness.py
    # (measured here: 2.7e-3 with its own row in float, 1.9e-2 without).
    assert (own_row - reference).abs().max() <= 1e-2
    no_window = window_logits(model, ids, "0")  # no key in float: int8 before 2026-12-06
    assert (no_window - reference).abs().max() > 1e-2
    block = window_logits(model, ids, "block")
    assert not torch.allclose(block, no_window, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(block, all_fresh, rtol=1e-4, atol=1e-4)
