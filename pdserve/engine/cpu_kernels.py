"""pdserve's own AVX2 (and, where the CPU has it, AVX-512) CPU kernels, built from C++ into one torch
extension on first use: the `native` value of each kernel setting (what EngineConfig's auto picks
where they build: pdserve/engine/kernel_choice.py).

    panel_matmul.cpp       torch.ops.pdserve.pack_panels, panel_matmul: y = x @ W.T for any rows of x,
    (+ _lanes.h)           W packed at load into panels of output columns (the native linear kernel,
                           pdserve/engine/linear.py)
    decode_attention.cpp   torch.ops.pdserve.paged_decode_attention: one query per sequence over its
                           K/V rows in the paged pool, read through its block table (the native
                           attention kernel, pdserve/engine/model.py)
    prefill_attention.cpp  torch.ops.pdserve.paged_prefill_attention: a prefill chunk's queries over
    (+ _lanes.h)           its sequence's rows in the pool, causal, flash-style (the same native
                           attention kernel, for prefill chunks)
    pointwise.cpp          torch.ops.pdserve.rms_norm, add_rms_norm_, silu_and_mul, rotary_: the work
                           between a layer's products, one pass each (the native pointwise kernel,
                           pdserve/engine/pointwise.py)
    kv_blocks.cpp          pack_layer_frame, verify_write_layer, checksum (kv_blocks()): KV blocks to
    (+ xxh3.h)             and from the wire, each block copied and hashed in one pass (pdserve/kvwire.py;
                           not a setting: every CPU pool takes it where the extension builds)
    gemv.cpp               torch.ops.pdserve.gemv: y = x @ W.T over W as stored, for a few rows; no
                           longer run by the engine (the panels serve those rows from the one copy
                           they keep), kept as bench.matmul_kernels' reference. It also holds
                           use_avx512(), the instruction-set switch every kernel asks.

    gemv(), panel_matmul(), paged_decode_attention(), paged_prefill_attention(), kv_blocks()
                                       the operators, or None where they cannot be built or run here
    paged_prefill_attention_on(path)   the prefill attention on its lanes or tiled path only
    the attentions' window argument    a sliding window: position p sees keys p - window < j <= p (0: all)
    prefill_attention_lane_rows()      the query rows a KV head up to which a chunk takes the lanes path
    gemv_isa()                         avx512 or avx2: which of their paths the kernels run on this CPU
    unavailable()                      why not, in words (None when they work)
    python -m pdserve.engine.cpu_kernels   builds them now (`make setup` does), and says where or why not

NOTE: why a matmul of our own. A decode step at batch 1 is a stream of the model's weights through
matrix-vector products, bound by memory bandwidth, and MKL's and oneDNN's fp32 kernels read the
weights there well below the rate a plain read of the same bytes reaches; from tens to hundreds of
rows (decode batches, short chunks) a product is still close to bound by reading W. The panels read
it in order at every row count (python -m bench.matmul_kernels; docs/benchmarks.md).

NOTE: why a decode attention of our own. torch's SDPA wants K/V as dense tensors, so every decode
step gathered each sequence's blocks into a padded copy, layer by layer, and at 32 concurrent
requests the gather and SDPA over the copy were close to half a step (python -m
bench.profile_engine, docs/benchmarks.md). The kernel reads the rows where they lie, once, as vLLM's
CPU backend's paged attention does.

NOTE: why a prefill attention of our own. A chunk after a cached prefix had its whole context
gathered out of the pool every layer and attended with an explicit mask, and torch's flash SDPA ran
well below the products' FLOP rate: attention was most of a short prefill after a long cached prefix
(bench.profile_engine). The kernel reads key tiles where they lie, shares each one among a KV head's
query heads and 12 query rows (6 in 8 lanes), and keeps an online softmax (vLLM's CPU backend also
runs its own prefill attention over the paged cache). A short chunk (a few queries after a long
cached prefix) takes its lanes path instead, with no transposed copy of the keys: the same bits,
faster (python -m bench.attention_kernels --only prefill times both against the gather + SDPA path).

The operators sum in their own order, in 8 or 16 lanes, so none is bit-equal to torch's kernels:
the exactness suite runs the engine on them (every test on the default kernels, and
tests/engine/test_linear_kernels.py, test_attention_kernels.py, test_pointwise.py by name), against
the no-cache reference on the same kernels; tests/engine/test_oracle.py pins torch's to meet
transformers at 1e-4.

Built with torch's C++ extension tooling (g++ and ninja) into torch's extension cache, under a name
that carries a digest of the sources, the flags and torch's version: an edit or another torch
rebuilds it, and a build for other flags is never loaded. Flags are -mavx2 -mfma, not
-march=native, because the machine's CPU model changes between sessions while the cache stays.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
from collections.abc import Callable
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Protocol

import torch

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name) for name in ("gemv.cpp", "decode_attention.cpp",
                                                            "prefill_attention.cpp", "pointwise.cpp",
                                                            "panel_matmul.cpp", "kv_blocks.cpp"))
HEADERS = tuple(Path(__file__).with_name(name)  # included by the sources: in the digest
                for name in ("prefill_attention_lanes.h", "cephes_exp.h", "panel_matmul_lanes.h", "xxh3.h"))
# NOTE: -fopenmp is what makes at::parallel_for parallel: without it the header's OpenMP pragma is
# ignored and the kernels run on one thread at about half their bandwidth.
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp")

Gemv = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class PagedDecodeAttention(Protocol):
    """torch.ops.pdserve.paged_decode_attention: q [B, H, D] over each row's context_lens[b] rows of
    cache [2, blocks, block_size, KVH, D] through block_tables [B, width]; window 0: every row."""

    def __call__(self, q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, window: int = 0) -> torch.Tensor: ...


class PagedPrefillAttention(Protocol):
    """torch.ops.pdserve.paged_prefill_attention: a chunk's q [T, H, D] from position start over the
    sequence's rows through block_table [width], causal; window 0: every row up to each query."""

    def __call__(self, q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, start: int,
                 scale: float, window: int = 0) -> torch.Tensor: ...


class PanelMatmul:
    """pdserve::panel_matmul as the native linear kernel calls it: pack(W) once at load, then
    panel(x, panels, out) = x @ W.T, out being W's row count."""

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        return torch.ops.pdserve.pack_panels(weight.contiguous())

    def __call__(self, x: torch.Tensor, panels: torch.Tensor, out: int) -> torch.Tensor:
        return torch.ops.pdserve.panel_matmul(x, panels, out)


def extension_name() -> str:
    sources = b"".join(source.read_bytes() for source in (*SOURCES, *HEADERS))
    key = sources + " ".join((*FLAGS, torch.__version__)).encode()
    digest = hashlib.sha256(key).hexdigest()[:12]
    return f"pdserve_cpu_kernels_{digest}"


def _cpu_has_avx2() -> bool:
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def _missing_tool() -> str | None:
    for tool in ("c++", "ninja"):
        if shutil.which(tool) is None:
            return tool
    return None


@cache
def _load() -> ModuleType | str:
    """The extension's module once the operators are registered; else why they cannot be."""
    if not _cpu_has_avx2():
        return f"this CPU has no AVX2 (torch reports {torch.backends.cpu.get_cpu_capability()})"
    tool = _missing_tool()
    if tool:
        return (f"building pdserve's CPU kernels needs {tool} on PATH; install it, "
                "or set the kernels to matmul/sdpa/torch (auto does so by itself)")
    from torch.utils.cpp_extension import load

    try:
        return load(extension_name(), [str(source) for source in SOURCES], extra_cflags=list(FLAGS),
                    extra_ldflags=["-fopenmp"], verbose=False)
    except (RuntimeError, OSError, ImportError) as e:  # a compiler error, or a broken cache entry
        log.warning("building pdserve's CPU kernels failed: %s", e)
        return f"building pdserve's CPU kernels failed ({e}); set the kernels to matmul/sdpa/torch or auto"


def _build() -> str | None:
    """None once the operators are registered; else why they cannot be."""
    loaded = _load()
    return loaded if isinstance(loaded, str) else None


def kv_blocks() -> ModuleType | None:
    """kv_blocks.cpp's functions (pack_layer_frame, verify_write_layer, checksum), or None where
    the extension cannot be built or run here (pdserve/kvwire.py then takes its Python path)."""
    loaded = _load()
    return None if isinstance(loaded, str) else loaded


def gemv() -> Gemv | None:
    return None if _build() else torch.ops.pdserve.gemv  # registered by loading the library


def gemv_isa() -> str | None:
    """The instruction set pdserve's kernels run here, avx512 or avx2 (PDSERVE_CPU_ISA=avx2 caps it)."""
    return None if _build() else torch.ops.pdserve.gemv_isa()


def panel_matmul() -> PanelMatmul | None:
    return None if _build() else PanelMatmul()


def paged_decode_attention() -> PagedDecodeAttention | None:
    return None if _build() else torch.ops.pdserve.paged_decode_attention


def paged_prefill_attention() -> PagedPrefillAttention | None:
    return None if _build() else torch.ops.pdserve.paged_prefill_attention


def paged_prefill_attention_on(path: str) -> PagedPrefillAttention | None:
    """The prefill attention on one of its two paths, lanes or tiled, whatever the chunk: the tests
    check that they give the same bits, and bench.attention_kernels times them. The engine calls
    paged_prefill_attention(), which picks by the chunk's rows (prefill_attention_lane_rows())."""
    if _build():
        return None
    op = torch.ops.pdserve.paged_prefill_attention_on
    return lambda q, cache, table, start, scale, window=0: op(q, cache, table, start, scale, path, window)


def prefill_attention_lane_rows() -> int | None:
    """Query rows a KV head up to which a prefill chunk takes the lanes path."""
    return None if _build() else torch.ops.pdserve.prefill_attention_lane_rows()


def unavailable() -> str | None:
    return _build()


def main() -> None:
    reason = unavailable()
    if reason:
        print(f"pdserve CPU kernels: not built: {reason}")
        return
    print(f"pdserve CPU kernels: built ({extension_name()})")


if __name__ == "__main__":
    main()
