"""A CPU engine keeps freed memory in the process: large temporaries reuse pages already mapped."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# Four 20 MB tensors a round (under glibc's 32 MB ceiling for heap allocations), freed at the end of
# it; prints, per round, how far the heap grew for them and how much of it free() gave back.
SCRIPT = """
import ctypes, json, torch
from pdserve.engine.cpu_allocator import retain_freed_memory
assert retain_freed_memory()
libc = ctypes.CDLL(None)
libc.sbrk.restype, libc.sbrk.argtypes = ctypes.c_void_p, (ctypes.c_long,)
rounds = []
for _ in range(16):
    start = libc.sbrk(0)
    tensors = [torch.empty(5 * 2**20).fill_(1.0) for _ in range(4)]
    grown = libc.sbrk(0)
    del tensors
    rounds.append({"grown": grown - start, "given_back": grown - libc.sbrk(0)})
print(json.dumps(rounds))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_heap_memory_stays_mapped_for_the_next_step():
    """Without it, glibc trims a freed heap top above its moving threshold back to the system, and
    the next step's tensors fault every page in again (385,000 page faults per 2,048-token SmolLM2
    prefill, docs/benchmarks.md)."""
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True)
    rounds = json.loads(out.stdout.strip().splitlines()[-1])
    grown = sum(r["grown"] for r in rounds)
    assert grown >= 80 * 2**20  # the tensors came from the heap, not from an mmap each
    assert grown <= 4 * 80 * 2**20  # the heap settles (alignment splits cost it a few rounds' growth)
    assert all(r["given_back"] == 0 for r in rounds)
    assert all(r["grown"] == 0 for r in rounds[8:])  # later rounds reuse pages already mapped


def test_a_cpu_engine_retains_freed_memory_unless_told_not_to(tiny_loaded):
    from dataclasses import replace

    from pdserve.engine.cpu_allocator import retain_freed_memory
    from pdserve.engine.llm_engine import LLMEngine
    from tests.conftest import make_engine

    retain_freed_memory.cache_clear()
    engine = make_engine(tiny_loaded)
    assert retain_freed_memory.cache_info().currsize == 1  # the engine called it
    retain_freed_memory.cache_clear()
    LLMEngine(tiny_loaded, replace(engine.config, retain_freed_memory=False))
    assert retain_freed_memory.cache_info().currsize == 0
