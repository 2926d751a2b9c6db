"""The fast form of the own-row rule (attend_with_own_rows) against the rule itself (with_own_rows)."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.model import sdpa_4d
from pdserve.engine.own_rows import attend_with_own_rows, with_own_rows

HEADS, KV_HEADS, DIM, SCALE = 6, 2, 16, 0.25


def case(start: int, q_len: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ctx = start + q_len
    q = torch.randn(q_len, HEADS, DIM, generator=g)
    stored = torch.randn(2, ctx, KV_HEADS, DIM, generator=g)
    own = tuple(stored[j, start:] + 0.1 * torch.randn(q_len, KV_HEADS, DIM, generator=g) for j in (0, 1))
    return q, stored[0], stored[1], own


@pytest.mark.parametrize(("start", "q_len"), [(0, 1), (0, 2), (0, 37), (1, 1), (5, 1), (16, 16), (9, 30)])
def test_the_fast_form_attends_as_the_rule(start, q_len):
    """Within float32 rounding, from the first token (no earlier row) to chunks after a cached prefix."""
    q, keys, values, own = case(start, q_len, seed=start * 100 + q_len)
    expected = sdpa_4d(q, *with_own_rows(keys, values, own, start), False, SCALE)
    got = attend_with_own_rows(q, keys, values, own, start, SCALE)
    assert got.shape == expected.shape
    assert (got - expected).abs().max() <= 1e-5


def test_the_first_token_attends_only_its_own_row():
    q, keys, values, own = case(0, 3, seed=3)
    got = attend_with_own_rows(q, keys, values, own, 0, SCALE)
    assert torch.allclose(got[0], own[1][0].repeat_interleave(HEADS // KV_HEADS, dim=0), atol=1e-6)


def test_a_dominant_own_row_does_not_lose_the_earlier_ones():
    """The merge is taken from the larger of the two softmax sums, so neither part underflows."""
    q, keys, values, own = case(4, 2, seed=5)
    own = (own[0] * 40, own[1])  # own scores far above the stored ones, for some heads
    expected = sdpa_4d(q, *with_own_rows(keys, values, own, 4), False, SCALE)
    got = attend_with_own_rows(q, keys, values, own, 4, SCALE)
    assert torch.isfinite(got).all()
    assert (got - expected).abs().max() <= 1e-5
