"""The model's matmuls: y = x @ W.T for a Linear weight W [out, in], by a chosen kernel.

    select_linear(device, kernel) -> Linear       (EngineConfig.linear_kernel, auto resolved first:
                                                   pdserve/engine/kernel_choice.py)
        matmul  MatmulLinear: torch.matmul over W.T kept contiguous; any device. What transformers runs
        onednn  OneDNNLinear: torch.ops.mkldnn._linear_pointwise over W packed once into oneDNN's
                blocked layout; x86 CPU builds of torch only
        native  NativeLinear: pdserve's panel matmul (pdserve/engine/panel_matmul.cpp) at every row
                count, W packed once into panels of output columns; an x86 CPU with AVX2 (16-lane
                panels where it has AVX-512) and the built extension (pdserve/engine/cpu_kernels.py)
    linear.prepare(W) once when the weights load; linear(x, prepared) every step

Each kernel keeps one copy of a weight, in its own layout: the model drops W once it is prepared.

NOTE: why three. torch's fp32 matmul on an x86 CPU goes to MKL's sgemm, which is what transformers
runs: the matmul kernel meets tests/engine/test_oracle.py's 1e-4. oneDNN (what vLLM's CPU backend
calls) and the panels run the same products faster (`python -m bench.matmul_kernels`;
docs/benchmarks.md) but sum in other orders, so they are held to their own no-cache reference and
transformers' greedy tokens (tests/engine/test_linear_kernels.py). native is what auto picks.

NOTE: why one layout for every row count. A decode step's products (one to a few rows of x) are
bound by reading W, and a prefill chunk's (hundreds to thousands of rows) by FMAs. The panel layout
serves both: one pass over a panel streams it in order for the few rows, and for many rows a block
of rows reuses each panel from L2. The GEMV (pdserve/engine/gemv.cpp, over W as stored) and oneDNN's
packed layout each needed a copy of W of their own beside the panels, and gained little or nothing
for it in the bench above: the panels ran at or above the GEMV at every row count, and at or above
oneDNN up to about a hundred rows, within a few percent of it beyond; in 8 lanes likewise (timed with
the kernels capped to AVX2 on an AVX-512 CPU: PDSERVE_CPU_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2; no
AVX2-only CPU timed yet).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from pdserve.engine import cpu_kernels
from pdserve.engine.cpu_kernels import PanelMatmul

# NOTE: why oneDNN's weights are packed. Given W as stored, [out, in], oneDNN reorders it into its
# blocked layout inside every call; packed once at load it runs faster from two rows up and changes
# no sum there (python -m bench.matmul_kernels: onednn against onednn_unpacked;
# tests/engine/test_linear_kernels.py). The layout is chosen for a batch of PACK_FOR_ROWS rows and
# serves every row count.
PACK_FOR_ROWS = 32


@dataclass(frozen=True)
class PanelWeight:
    """NativeLinear's copy of one weight: its panels [ceil(out / P)][in][P], and W's row count."""

    panels: torch.Tensor
    out: int


PreparedWeight = torch.Tensor | PanelWeight


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

    NOTE: at batch 1 (a GEMV that streams the weight) this layout ran the lm_head at about twice
    the bandwidth of F.linear's [out, in] under MKL (docs/benchmarks.md, profile).
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


class NativeLinear:
    """pdserve's panel matmul at every row count, over W packed once into panels.

    NOTE: each output sums its inputs in an order fixed by W's shape alone (panel_matmul.cpp), so a
    product's rows do not depend on the other rows of x, on the blocking or on the thread count:
    a step's result is a function of its own inputs, whichever rows share the step.
    """

    name = "native"

    def __init__(self, panel: PanelMatmul) -> None:
        self._panel = panel

    def prepare(self, weight: torch.Tensor) -> PanelWeight:
        return PanelWeight(self._panel.pack(weight), weight.shape[0])

    def __call__(self, x: torch.Tensor, prepared: PanelWeight) -> torch.Tensor:
        return self._panel(x.contiguous(), prepared.panels, prepared.out)

    @staticmethod
    def rows(prepared: PanelWeight, ids: torch.Tensor) -> torch.Tensor:
        """W's rows `ids`, [len(ids), in], read back out of the panels: the very values of W (a tied
        model's embedding lookup reads its lm_head's panels so, and keeps no table of its own)."""
        columns = prepared.panels.shape[2]
        return prepared.panels[ids // columns, :, ids % columns]


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
    """The kernel named by EngineConfig.linear_kernel, once auto is resolved; each only where it runs."""
    if kernel == "matmul":
        return MatmulLinear()
    if kernel == "onednn":
        if not onednn_available(device):
            raise ValueError(f"linear_kernel 'onednn' is not available on {device} with this torch build; "
                             "use matmul or auto")
        return OneDNNLinear()
    if kernel != "native":
        raise ValueError(f"linear kernel {kernel!r}: use matmul, onednn or native")
    if device.type != "cpu":
        raise ValueError(f"linear_kernel 'native' runs on the CPU only, not on {device}; use matmul or auto")
    panel = cpu_kernels.panel_matmul()
    if panel is None:
        raise ValueError(f"linear_kernel 'native' is not available: {cpu_kernels.unavailable()}; "
                         "use matmul or auto")
    return NativeLinear(panel)
