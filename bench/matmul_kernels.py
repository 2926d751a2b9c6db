"""The engine's two matmul kernels on SmolLM2's shapes: torch's default (MKL on x86) against oneDNN.

    python -m bench.matmul_kernels [--json] [--threads N] [--reps N]

NOTE: not kernels.py: bench/vllm_driver.py runs with bench/ on its sys.path, and transformers
probes `import kernels` (the Hugging Face kernels package) at import time.

For each product [M, in] x [in, out] of a SmolLM2 layer (qkv 576->960, gate_up 576->3072,
down 1536->576) and M rows (1: batch-1 decode; 14: a short suffix; 256; 2,048: a prefill chunk),
both kernels of pdserve/engine/linear.py (MatmulLinear, OneDNNLinear) run on 30 distinct weights
in turn, so that each call reads its weight from memory as a model's layers do. Reported: the
best of --reps passes (the least disturbed by other processes) as GFLOP/s and, for M = 1, the
weight bytes streamed per second; ratio = oneDNN / matmul.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from bench.common import bench_parser, environment, format_table, publish, set_threads, warn_if_busy
from pdserve.engine.linear import MatmulLinear, OneDNNLinear, onednn_available

SHAPES = {"qkv": (576, 960), "gate_up": (576, 3072), "down": (1536, 576)}
ROWS = (1, 14, 256, 2048)
LAYERS = 30


def best_seconds(fn: Any, reps: int) -> float:
    fn(0)  # warm-up: kernel selection, first touch
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        for layer in range(LAYERS):
            fn(layer)
        best = min(best, (time.perf_counter() - start) / LAYERS)
    return best


def measure(name: str, shape: tuple[int, int], rows: int, reps: int) -> dict[str, Any]:
    n_in, n_out = shape
    weights = [torch.randn(n_out, n_in) for _ in range(LAYERS)]
    x = torch.randn(rows, n_in)
    out: dict[str, Any] = {"product": name, "rows": rows}
    for kernel in (MatmulLinear(), OneDNNLinear()):
        prepared = [kernel.prepare(w) for w in weights]
        s = best_seconds(lambda layer, k=kernel, p=prepared: k(x, p[layer]), reps)
        out[f"{kernel.name}_gflops"] = 2 * rows * n_in * n_out / s / 1e9
        out[f"{kernel.name}_weight_gb_per_s"] = 4 * n_in * n_out / s / 1e9
    out["ratio"] = out["onednn_gflops"] / out["matmul_gflops"]
    return out


def report(result: dict[str, Any]) -> str:
    def streamed(r: dict[str, Any], kernel: str) -> Any:
        return r[f"{kernel}_weight_gb_per_s"] if r["rows"] == 1 else ""

    rows = [[r["product"], r["rows"], r["matmul_gflops"], r["onednn_gflops"], r["ratio"],
             streamed(r, "matmul"), streamed(r, "onednn")] for r in result["products"]]
    head = f"threads={result['threads']} best of {result['reps']} passes over {LAYERS} weights"
    return "\n".join([head, format_table(["product", "M", "matmul GFLOP/s", "oneDNN GFLOP/s", "ratio",
                                          "matmul GB/s", "oneDNN GB/s"], rows)])


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
    products = [measure(name, shape, rows, args.reps) for name, shape in SHAPES.items() for rows in ROWS]
    result = {"products": products, "threads": threads, "reps": args.reps,
              "environment": {**environment(threads), "loadavg_at_start": load}}
    publish(report(result), result, args.json)


if __name__ == "__main__":
    main()
