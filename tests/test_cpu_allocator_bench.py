"""bench.cpu_allocator's two sides differ in the engine setting it names, and in nothing else; each
workload it times runs on the prefix it names."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench.cpu_allocator import one_rep
from bench.engine import Ours


def test_each_side_builds_its_engine_with_its_own_retain_setting(tiny_loaded):
    on = Ours(tiny_loaded, 16, 16, 1, retain_freed_memory=True).engine.config
    off = Ours(tiny_loaded, 16, 16, 1, retain_freed_memory=False).engine.config
    assert on.retain_freed_memory and not off.retain_freed_memory
    assert replace(off, retain_freed_memory=True) == on


def test_each_workload_finds_the_prefix_it_names(tiny_loaded):
    ours = Ours(tiny_loaded, 64, 16, 1)
    prompt = [(7 * i + 3) % 250 + 5 for i in range(200)]
    times = one_rep(ours, prompt, 160, 14, other=[9] * 32)
    assert set(times) == {"cold", "warm128", "suffix14"} and all(t > 0 for t in times.values())
    # 170 is not whole 16-token blocks: the cache holds 160 of them, and the bench refuses the run
    with pytest.raises(AssertionError, match="found 160 cached, not 170"):
        one_rep(ours, prompt, 170, 14, other=[9] * 32)
