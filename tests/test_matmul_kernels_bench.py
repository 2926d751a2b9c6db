"""bench.matmul_kernels times every kernel the engine's linear_kernel settings run, on the same
product: its kernels() and measure()."""

from __future__ import annotations

import pytest
import torch

from bench.matmul_kernels import PanelsAtAnyRows, kernels, measure
from pdserve.engine import cpu_kernels
from pdserve.engine.linear import onednn_available


@pytest.mark.skipif(not onednn_available(torch.device("cpu")) or cpu_kernels.unavailable() is not None,
                    reason="needs oneDNN and pdserve's CPU kernels")
def test_every_kernel_is_timed_on_the_same_product():
    linears = kernels()
    assert [k.name for k in linears] == ["matmul", "onednn", "onednn_unpacked", "gemv", "panel"]
    result = measure("down", (40, 24), 5, 1, linears)
    for name in ("matmul", "onednn", "onednn_unpacked", "gemv", "panel"):
        assert result[f"{name}_gflops"] > 0
    assert result["ratio"] == result["onednn_gflops"] / result["matmul_gflops"]


@pytest.mark.skipif(cpu_kernels.unavailable() is not None, reason=f"{cpu_kernels.unavailable()}")
def test_the_panel_column_computes_the_product():
    panel = PanelsAtAnyRows(cpu_kernels.panel_matmul())
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(9, 40, generator=g), torch.randn(24, 40, generator=g)
    assert torch.allclose(panel(x, panel.prepare(w)), x @ w.t(), atol=1e-5, rtol=1e-5)
