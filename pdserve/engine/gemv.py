"""pdserve's AVX2 GEMV (gemv.cpp): y = x @ W.T for up to MAX_ROWS rows of x, W [out, in] float32.

A GEMV in name: for one row of x it is one, and for a few rows (a decode batch, a short prefill
suffix) it still reads each weight row from memory once and dots it with every row of x.

    kernel()          the operator torch.ops.pdserve.gemv, or None where it cannot be built or run here
    unavailable()     why not, in words (None when it works)
    python -m pdserve.engine.gemv   builds it now (`make setup` does), and says where or why not

NOTE: why a kernel of our own. A decode step at batch 1 is a stream of the model's weights through
matrix-vector products, and it is bound by memory bandwidth. On the 2-core AMD EPYC machines this
project runs on, torch's MKL GEMV and oneDNN's read SmolLM2's weights at 9-19 GB/s where a plain
read of the same bytes (`w.sum()`) runs at 17-24 GB/s; this kernel reads them at 12-21 GB/s, and
from 2 to 32 rows it led oneDNN 1.1-2.2x (python -m bench.matmul_kernels). bench.engine's batch-1
decode step took 47-56 ms with it against oneDNN's 59 ms (docs/benchmarks.md, 2026-12-03).
It sums each dot product in 8 lanes, in its own order, so like oneDNN it is not bit-equal to MKL:
it serves only the opt-in `avx2` linear kernel (pdserve/engine/linear.py).

Built with torch's C++ extension tooling (g++ and ninja) on first use, into torch's extension cache,
under a name that carries a digest of the source, the flags and torch's version: an edit or another
torch rebuilds it, and a build for other flags is never loaded. Flags are -mavx2 -mfma, not
-march=native, because the machine's CPU model changes between sessions while the cache stays.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
from collections.abc import Callable
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# Rows of x up to which the kernel beat oneDNN on every SmolLM2 layer product (qkv, gate_up, down)
# on 2 threads in two runs of python -m bench.matmul_kernels: 1.1-2.2x from 2 to 32 rows, still
# ahead at 64, and the two cross at 128 (docs/benchmarks.md, 2026-12-03).
MAX_ROWS = 32
SOURCE = Path(__file__).with_name("gemv.cpp")
# NOTE: -fopenmp is what makes at::parallel_for parallel: without it the header's OpenMP pragma is
# ignored and the kernel runs on one thread at about half its bandwidth.
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp")

Gemv = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def extension_name() -> str:
    key = SOURCE.read_bytes() + " ".join((*FLAGS, torch.__version__)).encode()
    digest = hashlib.sha256(key).hexdigest()[:12]
    return f"pdserve_gemv_{digest}"


def _cpu_has_avx2() -> bool:
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def _missing_tool() -> str | None:
    for tool in ("c++", "ninja"):
        if shutil.which(tool) is None:
            return tool
    return None


@cache
def _build() -> tuple[Gemv | None, str | None]:
    if not _cpu_has_avx2():
        return None, f"this CPU has no AVX2 (torch reports {torch.backends.cpu.get_cpu_capability()})"
    tool = _missing_tool()
    if tool:
        return None, f"building the GEMV kernel needs {tool} on PATH; install it, or use linear_kernel onednn"
    from torch.utils.cpp_extension import load

    try:
        load(extension_name(), [str(SOURCE)], extra_cflags=list(FLAGS), extra_ldflags=["-fopenmp"],
             verbose=False)
    except (RuntimeError, OSError, ImportError) as e:  # a compiler error, or a broken cache entry
        log.warning("building the GEMV kernel failed: %s", e)
        return None, f"building the GEMV kernel failed ({e}); use linear_kernel onednn"
    return torch.ops.pdserve.gemv, None  # registered by loading the library (gemv.cpp)


def kernel() -> Gemv | None:
    return _build()[0]


def unavailable() -> str | None:
    return _build()[1]


def main() -> None:
    reason = unavailable()
    if reason:
        print(f"pdserve GEMV kernel: not built: {reason}")
        return
    print(f"pdserve GEMV kernel: built ({extension_name()})")


if __name__ == "__main__":
    main()
