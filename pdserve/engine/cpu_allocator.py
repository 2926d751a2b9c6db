"""Keep freed memory in the process on the CPU, so a step's large temporaries reuse pages already mapped.

A prefill step allocates and frees tensors of many megabytes (a 2,048-token chunk's gate/up product
alone is 25 MB). glibc's malloc gives the heap's free top back to the system once it passes a moving
threshold (at most 64 MB), and serves a request above its mmap threshold with an mmap of its own,
unmapped on free; either way the next step faults those pages in again, zeroed, on every cold
prefill. With the heap never trimmed and requests up to 32 MB served from it, later prefills fault
almost none and a cold prefill runs faster: `python -m bench.cpu_allocator` measures the page faults,
the time and the resident memory of both sides. vLLM's CPU
guide gets the same by asking its users to preload tcmalloc (its "Performance tips"); this does it
with glibc's own mallopt, in-process. The cost: the process keeps its peak heap, as a GPU caching
allocator keeps its blocks.

    retain_freed_memory()   set glibc's thresholds (once per process); False where the process's
                            malloc is not glibc's (then nothing changes)
    release_freed_memory()  give the free pages of the heap back to the system now (malloc_trim): once,
                            after the weights as loaded are freed (LLMEngine.from_config), since the
                            retained heap would otherwise keep their transient copies resident
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from functools import cache

log = logging.getLogger(__name__)

# glibc's <malloc.h> parameter numbers
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# NOTE: 32 MB is glibc's own ceiling for its moving threshold: a larger request still gets an mmap of its
# own (served from the heap, it can strand the heap's free chunks: its alignment padding outgrows them).
MMAP_THRESHOLD_BYTES = 32 * 2**20
TRIM_THRESHOLD_BYTES = (1 << 31) - 1  # never give the heap's free top back (an int's largest value)


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c"))
    except (OSError, TypeError):  # no C library by that name
        return None


def release_freed_memory() -> bool:
    """Return the heap's free pages to the system (glibc's malloc_trim); False where there is none."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is None:
        return False
    trim.argtypes, trim.restype = (ctypes.c_size_t,), ctypes.c_int
    return trim(0) == 1


@cache
def retain_freed_memory() -> bool:
    """Serve large allocations from the heap and keep freed heap memory mapped; True once set."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # no C library by that name, or one without mallopt
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    done = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1 and mallopt(_M_TRIM_THRESHOLD,
                                                                             TRIM_THRESHOLD_BYTES) == 1
    if not done:
        log.info("glibc refused the malloc thresholds; freed memory goes back to the system as before")
    return done
