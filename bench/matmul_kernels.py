"""The engine's matmul kernels on SmolLM2's shapes: torch's default (MKL on x86), oneDNN, pdserve's GEMV
and panel matmul.

    python -m bench.matmul_kernels [--json] [--threads N] [--reps N]

NOTE: not kernels.py: bench/vllm_driver.py runs with bench/ on its sys.path, and transformers
probes `import kernels` (the Hugging Face kernels package) at import time.

For each product [M, in] x [in, out] of a SmolLM2 layer (qkv 576->960, gate_up 576->3072,
down 1536->576, and lm_head 576->49,152 with M of 1 to 8) and M rows (1: batch-1 decode; 2 to 32:
decode batches; 14: a short suffix; 64, 128; 256, 512; 2,048: a prefill chunk), each kernel runs on 30
distinct weights in turn (lm_head: 3), so that each call reads its weight from memory as a model's
layers do: MatmulLinear and OneDNNLinear of pdserve/engine/linear.py (the weight packed once into
oneDNN's layout), onednn_unpacked (oneDNN given W as stored, reordering it in every call: what
OneDNNLinear ran before 2026-12-06), and pdserve::gemv (pdserve/engine/gemv.cpp) and
pdserve::panel_matmul (pdserve/engine/panel_matmul.cpp, its panels packed once) at every row count
where they build. The native linear kernel (what auto picks) runs the panels at every row count,
from the one copy of each weight it keeps: the panel column against the gemv and onednn ones is
what that choice rests on (pdserve/engine/linear.py).
Reported: the best of --reps passes (the least disturbed by other processes) as GFLOP/s and the
weight bytes streamed per second; ratio = oneDNN / matmul; and, for reference, the bytes per second
of a plain read of the same weights (w.sum()), the bandwidth a GEMV can approach.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from bench.common import bench_parser, environment, format_table, publish, set_threads, warn_if_busy
from pdserve.engine import cpu_kernels
from pdserve.engine.linear import Linear, MatmulLinear, OneDNNLinear, onednn_available

SHAPES = {"qkv": (576, 960), "gate_up": (576, 3072), "down": (1536, 576), "lm_head": (576, 49152)}
ROWS = (1, 2, 4, 8, 14, 32, 64, 128, 256, 512, 2048)
LM_HEAD_ROWS = (1, 2, 4, 8)  # lm_head runs on the sampled rows only: one per decode sequence
LAYERS = 30
WEIGHT_COPIES = {"lm_head": 3}  # 113 MB each: 3 copies already exceed any cache


def best_seconds(fn: Any, reps: int, copies: int) -> float:
    fn(0)  # warm-up: kernel selection, first touch
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        for layer in range(copies):
            fn(layer)
        best = min(best, (time.perf_counter() - start) / copies)
    return best


class GemvAtAnyRows:
    """pdserve::gemv as a Linear, at every row count (a reference: the engine no longer runs it)."""

    name = "gemv"

    def __init__(self, kernel: cpu_kernels.Gemv) -> None:
        self._kernel = kernel

    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.contiguous()

    def __call__(self, x: torch.Tensor, prepared: torch.Tensor) -> torch.Tensor:
        return self._kernel(x, prepared)


class PanelsAtAnyRows:
    """pdserve::panel_matmul as a Linear, at every row count (as the engine's native kernel runs it)."""

    name = "panel"

    def __init__(self, kernel: cpu_kernels.PanelMatmul) -> None:
        self._kernel = kernel

    def prepare(self, weight: torch.Tensor) -> tuple[torch.Tensor, int]:
        return self._kernel.pack(weight), weight.shape[0]

    def __call__(self, x: torch.Tensor, prepared: tuple[torch.Tensor, int]) -> torch.Tensor:
        return self._kernel(x, *prepared)


class OneDNNUnpacked(OneDNNLinear):
    """oneDNN over W [out, in] as stored, without the packing OneDNNLinear.prepare does."""

    name = "onednn_unpacked"

    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.contiguous()


def kernels() -> list[Linear]:
    """matmul, onednn and onednn_unpacked, and pdserve's GEMV and panel matmul where they build here
    (it says why not, once)."""
    found: list[Linear] = [MatmulLinear(), OneDNNLinear(), OneDNNUnpacked()]
    gemv, panel = cpu_kernels.gemv(), cpu_kernels.panel_matmul()
    if gemv is None or panel is None:
        print(f"gemv and panel left out: {cpu_kernels.unavailable()}")
    else:
        found += [GemvAtAnyRows(gemv), PanelsAtAnyRows(panel)]
    return found


def measure(name: str, shape: tuple[int, int], rows: int, reps: int, linears: list[Linear]) -> dict[str, Any]:
    n_in, n_out = shape
    copies = WEIGHT_COPIES.get(name, LAYERS)
    weights = [torch.randn(n_out, n_in) for _ in range(copies)]
    x = torch.randn(rows, n_in)
    out: dict[str, Any] = {"product": name, "rows": rows}
    s = best_seconds(lambda layer: weights[layer].sum(), reps, copies)
    out["read_weight_gb_per_s"] = 4 * n_in * n_out / s / 1e9
    for kernel in linears:
        prepared = [kernel.prepare(w) for w in weights]
        s = best_seconds(lambda layer, k=kernel, p=prepared: k(x, p[layer]), reps, copies)
        out[f"{kernel.name}_gflops"] = 2 * rows * n_in * n_out / s / 1e9
        out[f"{kernel.name}_weight_gb_per_s"] = 4 * n_in * n_out / s / 1e9
    out["ratio"] = out["onednn_gflops"] / out["matmul_gflops"]
    return out


def report(result: dict[str, Any]) -> str:
    names = result["kernels"]
    rows = [[r["product"], r["rows"], *(r[f"{k}_gflops"] for k in names), r["ratio"],
             *(r[f"{k}_weight_gb_per_s"] for k in names), r["read_weight_gb_per_s"]]
            for r in result["products"]]
    head = (f"threads={result['threads']} best of {result['reps']} passes over {LAYERS} weights "
            f"(lm_head: 3); gemv on {result['gemv_isa'] or 'nothing'}")
    headers = ["product", "M", *(f"{k} GFLOP/s" for k in names), "oneDNN/matmul",
               *(f"{k} GB/s" for k in names), "read GB/s"]
    return "\n".join([head, format_table(headers, rows)])


def main(argv: list[str] | None = None) -> None:
    p = bench_parser("python -m bench.matmul_kernels", __doc__)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default: %(default)s)")
    p.add_argument("--reps", type=int, default=7,
                   help="passes per kernel; the best is kept (default: %(default)s)")
    args = p.parse_args(argv)
    if not onednn_available(torch.device("cpu")):
        p.error("this torch build has no oneDNN linear on this CPU; nothing to compare")
    threads = set_threads(args.threads)
    load = warn_if_busy(threads)
    linears = kernels()
    products = [measure(name, shape, rows, args.reps, linears) for name, shape in SHAPES.items()
                for rows in (LM_HEAD_ROWS if name == "lm_head" else ROWS)]
    result = {"products": products, "kernels": [k.name for k in linears], "threads": threads,
              "gemv_isa": cpu_kernels.gemv_isa(),
              "reps": args.reps,
              "environment": {**environment(threads), "loadavg_at_start": load}}
    publish(report(result), result, args.json)


if __name__ == "__main__":
    main()
