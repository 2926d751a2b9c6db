"""sim/measure/sharing.py: the pair measurement's probes run the steps they name, and its ratios are
engine 0's medians together over alone (the two engine processes themselves are `pdserve sim calibrate`'s
run)."""

from __future__ import annotations

import pytest

from sim.measure.sharing import pair_ratios, probe
from tests.conftest import assert_no_leaks, make_engine


def test_a_probe_times_two_decode_batches_and_a_prefill_and_leaves_every_block_free(tiny_loaded):
    engine = make_engine(tiny_loaded)
    times = probe(engine)
    assert set(times) == {"decode1_ms", "decode4_ms", "prefill_ms"} and all(t > 0 for t in times.values())
    assert engine.last_step.prefill and not engine.has_unfinished()
    assert_no_leaks(engine)


def test_the_ratios_are_medians_together_over_medians_alone():
    alone = [{"decode1_ms": 10.0, "prefill_ms": 100.0}, {"decode1_ms": 30.0, "prefill_ms": 300.0},
             {"decode1_ms": 20.0, "prefill_ms": 200.0}]
    together = [{"decode1_ms": 25.0, "prefill_ms": 210.0}, {"decode1_ms": 22.0, "prefill_ms": 260.0},
                {"decode1_ms": 40.0, "prefill_ms": 250.0}]
    out = pair_ratios(alone, together, rounds=3)
    assert out["alone"] == {"decode1_ms": 20.0, "prefill_ms": 200.0}
    assert out["together"] == {"decode1_ms": 25.0, "prefill_ms": 250.0}
    assert out["decode1_ms_together_over_alone"] == pytest.approx(1.25)
    assert out["prefill_ms_together_over_alone"] == pytest.approx(1.25)
    assert out["rounds"] == 3
