"""bench.kv_quant_window's variants: the masks, and that its dense pass is the engine model's
reference at both ends (every key in float: float32's logits; none: int8's)."""

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
    no_window = window_logits(model, ids, "0")  # no key in float: today's int8
    # dense einsums against SDPA: the same sums in another order, so logits agree to 1e-3, not bit for bit
    torch.testing.assert_close(no_window, model.reference_logits(ids, "int8"), rtol=1e-3, atol=1e-3)
    block = window_logits(model, ids, "block")
    assert not torch.allclose(block, no_window, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(block, all_fresh, rtol=1e-4, atol=1e-4)
