"""bench.prefill_ttft times each workload on the prefix it names: a cold prompt finds nothing cached,
the warm ones find exactly the cached tokens, on either attention kernel."""

from __future__ import annotations

import pytest

from bench.engine import Ours
from bench.prefill_ttft import one_rep
from pdserve.engine import cpu_kernels

KERNELS = ["sdpa", pytest.param("avx2", marks=pytest.mark.skipif(cpu_kernels.unavailable() is not None,
                                                                 reason=f"{cpu_kernels.unavailable()}"))]


@pytest.mark.parametrize("kernel", KERNELS)
def test_each_workload_finds_the_prefix_it_names(tiny_loaded, kernel):
    ours = Ours(tiny_loaded, 64, 16, 1, attention_kernel=kernel)
    prompt = [(7 * i + 3) % 250 + 5 for i in range(200)]
    times = one_rep(ours, prompt, 160, 14, other=[9] * 32)
    assert set(times) == {"cold", "warm128", "suffix14"} and all(t > 0 for t in times.values())
    # 170 is not whole 16-token blocks: the cache holds 160 of them, and the bench refuses the run
    with pytest.raises(AssertionError, match="found 160 cached, not 170"):
        one_rep(ours, prompt, 170, 14, other=[9] * 32)
