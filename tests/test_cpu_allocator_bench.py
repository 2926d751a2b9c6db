"""bench.cpu_allocator's two sides differ in the engine setting it names, and in nothing else."""

from __future__ import annotations

from dataclasses import replace

from bench.engine import Ours


def test_each_side_builds_its_engine_with_its_own_retain_setting(tiny_loaded):
    on = Ours(tiny_loaded, 16, 16, 1, retain_freed_memory=True).engine.config
    off = Ours(tiny_loaded, 16, 16, 1, retain_freed_memory=False).engine.config
    assert on.retain_freed_memory and not off.retain_freed_memory
    assert replace(off, retain_freed_memory=True) == on
