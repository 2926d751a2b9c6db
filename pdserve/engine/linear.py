"""The model's matmuls: y = x @ W.T for a Linear weight W [out, in], by a chosen kernel.

    select_linear(device, kernel) -> Linear       (EngineConfig.linear_kernel)
        matmul  MatmulLinear: torch.matmul over W.T kept contiguous; any device. The default.
        onednn  OneDNNLinear: torch.ops.mkldnn._linear_pointwise over W packed once into oneDNN's
                blocked layout; x86 CPU builds of torch only
        avx2    Avx2Linear: pdserve's GEMV (pdserve/engine/gemv.cpp) for up to max_gemv_rows() rows
                (32 on AVX2; 2 where the CPU has AVX-512, which the GEMV then runs), there pdserve's
                panel matmul (pdserve/engine/panel_matmul.cpp) up to max_panel_rows() rows (128),
                and oneDNN above; an x86 CPU with AVX2, oneDNN, and a C++ compiler and ninja to build
                the kernels. It keeps a copy of every weight for each kernel it runs: W for the
                GEMV, oneDNN's packed one, and on AVX-512 the panels, three times the weights'
                memory there (SmolLM2: 1.62 GB instead of 540 MB; twice on an AVX2-only CPU)
    linear.prepare(W) once when the weights load; linear(x, prepared) every step

NOTE: why two. torch's fp32 matmul on an x86 CPU goes to MKL's sgemm, which on the AMD EPYC
machines this project runs on reached 40-108 GFLOP/s on one thread against oneDNN's 59-236 for
the same products (M of 14 to 2,048 rows by SmolLM2's qkv, gate_up and down weights), and about
the same bandwidth at M = 1 (`python -m bench.matmul_kernels`; docs/benchmarks.md). vLLM's CPU
backend calls oneDNN. But MKL is what transformers runs: our matmul path meets
tests/engine/test_oracle.py's 1e-4 (a one-off check on four SmolLM2 prompts found 0.0 max-abs),
while oneDNN sums in another order and its logits differed by up to 5e-3 in the same check, which
that test does not allow. So oneDNN is opt-in, and tests/engine/test_linear_kernels.py runs the
exactness suite on it (its own no-cache reference at 1e-4; transformers on greedy tokens). avx2 adds
a GEMV of our own for decode-sized products, which both libraries run well below the memory
bandwidth that bounds them (pdserve/engine/cpu_kernels.py); it sums in its own order too, so it is
opt-in as well and under the same tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from pdserve.engine import cpu_kernels
from pdserve.engine.cpu_kernels import Gemv, PanelMatmul

# Rows of x up to which the GEMV runs, by torch's CPU capability (the widest vector ISA, which
# oneDNN runs too) and the GEMV's own instruction set (cpu_kernels.gemv_isa). On an AVX2-only CPU
# the GEMV beat oneDNN on every SmolLM2 layer product (qkv, gate_up, down) on 2 threads in two runs
# of python -m bench.matmul_kernels: 1.1-2.2x from 2 to 32 rows, still ahead at 64, crossing at 128
# (2026-12-03). Where the CPU has AVX-512, oneDNN's 16-lane kernels led the AVX2 GEMV on every
# product from 8 rows up, and the AVX-512 GEMV led or tied oneDNN up to 8 rows, mixed at 14
# (2026-12-04's Zen 5, both runs of each; docs/benchmarks.md).
MAX_GEMV_ROWS = 32
GEMV_CROSSOVER = {("AVX512", "avx512"): 8, ("AVX512", "avx2"): 4}
# Rows of x up to which the panel matmul runs, from where the GEMV stops (2 rows, PANEL_GEMV_ROWS),
# by the same pair. On 2026-12-06's AVX-512 Xeon (python -m bench.matmul_kernels --threads 1 and 2
# --reps 5, 07:40; docs/benchmarks.md), against oneDNN on SmolLM2's qkv, gate_up and down products:
# 14 rows 1.16-2.25x, 32 rows 0.99-1.24x, 128 rows 0.95-1.18x (1.00-1.18x on 2 threads), 256 rows
# 0.93-1.05x, 2,048 rows 0.76-0.96x; against the GEMV, 0.78-1.24x at 2 rows, 0.89-1.16x at 4 and
# 0.70-1.88x at 8 (the GEMV stays ahead on down). That Xeon's 480 MB L3 holds the bench's 30 copies
# of a weight, so those are cache rates; streamed from memory the panels read 19-20 GB/s at 14 rows.
# Not measured in 8 lanes: an AVX2-only CPU keeps the GEMV and oneDNN alone.
PANEL_CROSSOVER = {("AVX512", "avx512"): 128}
PANEL_GEMV_ROWS = 2
# NOTE: why oneDNN's weights are packed. Given W as stored, [out, in], oneDNN reorders it into its
# blocked layout inside every call; packed once at load, qkv's product ran 1.3-1.65x faster on one
# thread at 2 to 32 rows, gate_up's 1.15-1.33x, down's no faster (python -m bench.matmul_kernels:
# onednn against onednn_unpacked), and SmolLM2's cold 2,048-token prefill 1.05-1.10x and a 14-token
# prefill 1.33-1.37x faster, tokens identical: from two rows up the packing changes no sum
# (tests/engine/test_linear_kernels.py; docs/benchmarks.md, 2026-12-06; at one row oneDNN given W as
# stored runs a GEMV path of its own, about as fast, which sums in another order). The layout is chosen for a
# batch of PACK_FOR_ROWS rows and serves every row count (packed for 2,048 rows it was no faster there).
PACK_FOR_ROWS = 32


def max_gemv_rows(capability: str | None = None, gemv_isa: str | None = None) -> int:
    """The avx2 kernel's GEMV/oneDNN crossover on a CPU of `capability` with the GEMV running
    `gemv_isa` (default: this CPU's, and the path the GEMV runs here). Where the panel matmul runs
    (max_panel_rows() > 0) the GEMV stops at PANEL_GEMV_ROWS instead: Avx2Linear.gemv_rows."""
    capability = capability or torch.backends.cpu.get_cpu_capability()
    gemv_isa = gemv_isa or cpu_kernels.gemv_isa() or "avx2"
    return GEMV_CROSSOVER.get((capability, gemv_isa), MAX_GEMV_ROWS)


def max_panel_rows(capability: str | None = None, gemv_isa: str | None = None) -> int:
    """Rows up to which the avx2 kernel runs the panel matmul (0: never) on a CPU of `capability`
    with pdserve's kernels on `gemv_isa` (default: this CPU's)."""
    capability = capability or torch.backends.cpu.get_cpu_capability()
    gemv_isa = gemv_isa or cpu_kernels.gemv_isa() or "avx2"
    return PANEL_CROSSOVER.get((capability, gemv_isa), 0)


@dataclass(frozen=True)
class Avx2Weight:
    """Avx2Linear's copies of one weight: [out, in] for the GEMV; panels for the panel matmul (None
    where it does not run); oneDNN's packed one for more rows."""

    weight: torch.Tensor
    panels: torch.Tensor | None
    packed: torch.Tensor


PreparedWeight = torch.Tensor | Avx2Weight


class Linear(Protocol):
    name: str

    def prepare(self, weight: torch.Tensor) -> PreparedWeight:
        """The weight [out, in] as this kernel wants it stored."""
        ...

    def __call__(self, x: torch.Tensor, prepared: PreparedWeight) -> torch.Tensor:
        """x [T, in] -> [T, out]."""
        ...


class MatmulLinear:
    """x @ W.T with W kept transposed, [in, out] and contiguous.

    NOTE: at batch 1 (a GEMV that streams the weight) this layout ran the 113 MB lm_head at about
    twice the bandwidth of F.linear's [out, in] under MKL (docs/benchmarks.md, profile).
    """

    name = "matmul"

    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.t().contiguous()

    def __call__(self, x: torch.Tensor, prepared: torch.Tensor) -> torch.Tensor:
        return x @ prepared


class OneDNNLinear:
    """oneDNN's fp32 inner product over W packed into oneDNN's blocked layout (W [out, in] as given
    works too, reordered in every call)."""

    name = "onednn"

    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_FOR_ROWS)

    def __call__(self, x: torch.Tensor, prepared: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, prepared, None, "none", [], "")


class Avx2Linear:
    """pdserve's GEMV for a few rows of x (a decode step's products), its panel matmul for tens to
    hundreds (where the CPU has AVX-512), oneDNN for more; W [out, in].

    NOTE: a product's kernel depends on its row count only, never on the values, so a step's
    result is a function of its inputs; which rows share a step can change which kernel runs,
    as it can change oneDNN's own blocking.
    """

    name = "avx2"

    def __init__(self, gemv: Gemv, panel: PanelMatmul | None = None, gemv_rows: int | None = None,
                 panel_rows: int | None = None) -> None:
        self._gemv, self._panel = gemv, panel
        self._onednn = OneDNNLinear()
        self.panel_rows = (max_panel_rows() if panel_rows is None else panel_rows) if panel else 0
        self.gemv_rows = gemv_rows or (PANEL_GEMV_ROWS if self.panel_rows else max_gemv_rows())

    def prepare(self, weight: torch.Tensor) -> Avx2Weight:
        weight = weight.contiguous()
        panels = self._panel.pack(weight) if self.panel_rows else None
        return Avx2Weight(weight, panels, self._onednn.prepare(weight))

    def __call__(self, x: torch.Tensor, prepared: Avx2Weight) -> torch.Tensor:
        rows = x.shape[0]
        if rows <= self.gemv_rows:
            return self._gemv(x.contiguous(), prepared.weight)
        if rows <= self.panel_rows:
            return self._panel(x.contiguous(), prepared.panels, prepared.weight.shape[0])
        return self._onednn(x, prepared.packed)


def onednn_available(device: torch.device) -> bool:
    """oneDNN's linear works here: an x86 CPU build of torch with mkldnn, checked by one call."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    try:
        x, w, onednn = torch.ones(2, 3), torch.ones(4, 3), OneDNNLinear()
        return bool(torch.equal(onednn(x, onednn.prepare(w)), torch.full((2, 4), 3.0)))
    except (RuntimeError, AttributeError):
        return False


def select_linear(device: torch.device, kernel: str = "matmul") -> Linear:
    """The kernel named by EngineConfig.linear_kernel; onednn only where it works."""
    if kernel == "matmul":
        return MatmulLinear()
    if kernel not in ("onednn", "avx2"):
        raise ValueError(f"linear kernel {kernel!r}: use matmul, onednn or avx2")
    if not onednn_available(device):
        raise ValueError(f"linear_kernel {kernel!r} is not available on {device} with this torch build; "
                         "use matmul")
    if kernel == "onednn":
        return OneDNNLinear()
    gemv = cpu_kernels.gemv()
    if gemv is None:
        raise ValueError(f"linear_kernel 'avx2' is not available: {cpu_kernels.unavailable()}")
    return Avx2Linear(gemv, cpu_kernels.panel_matmul())
