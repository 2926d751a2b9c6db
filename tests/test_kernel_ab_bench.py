"""bench.kernel_ab runs every workload on both sides, the two engines alike but in the one setting."""

from __future__ import annotations

import pytest

from bench.engine import Ours, Sizes, kv_blocks_needed
from bench.kernel_ab import WORKLOADS, alternate, main
from tests.engine.kernel_checks import needs_kernel

SMALL = Sizes(prefill_lengths=(64,), decode_new_tokens=5, concurrent_requests=3,
              concurrent_prompt_range=(4, 20), concurrent_output_range=(2, 5), warm_prompt_tokens=64,
              warm_cached_tokens=48)


@needs_kernel
def test_each_side_times_every_workload_in_every_rep(tiny_loaded):
    sides = {v: Ours(tiny_loaded, kv_blocks_needed(SMALL), SMALL.block_size, 1, pointwise_kernel=v)
             for v in ("torch", "avx2")}
    assert [s.engine.config.pointwise_kernel for s in sides.values()] == ["torch", "avx2"]
    times = alternate(sides, 2, SMALL)
    for value in sides:
        assert set(times[value]) == set(WORKLOADS)
        assert all(len(t) == 2 and min(t) > 0 for t in times[value].values())
        assert not sides[value].engine.leaked_blocks()


def test_a_value_of_another_setting_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        main(["--setting", "attention_kernel", "--values", "sdpa", "torch"])
    assert "'torch' is not a attention_kernel; use sdpa, avx2" in capsys.readouterr().err
