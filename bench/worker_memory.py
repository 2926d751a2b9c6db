"""Resident memory of each worker of `pdserve up`'s default cluster (1 prefill + 1 decode, SmolLM2, the
default kernels), against what the worker must hold: its float32 weights once (pdserve plan), its KV
pool, and a runtime allowance.

    budget = weights x 1.3 + KV pool + 300 MB           (the figure docs/benchmarks.md's row states)
    ratio  = the worker's RSS ÷ budget                  (<= 1: within it)

RSS is read with psutil from each worker actor's process (found by its `ray::` title) once the
cluster answers, and again after it has served `--requests` greedy requests, so the KV pool's pages
and the transfer path have been touched.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any

from bench import common

RUNTIME_ALLOWANCE_BYTES = 300_000_000
WEIGHT_FACTOR = 1.3
PROMPT = "Summarise the plot of a short story about a lighthouse keeper and a storm, in detail. " * 8


@dataclass(frozen=True)
class Budget:
    weight_bytes: int
    kv_pool_bytes: int

    @property
    def total(self) -> int:
        return int(self.weight_bytes * WEIGHT_FACTOR) + self.kv_pool_bytes + RUNTIME_ALLOWANCE_BYTES


def budget_of(spec: Any) -> Budget:
    from pdserve.engine.config import CPU_KV_CACHE_GIB, kv_bytes_per_token
    from pdserve.engine.weights import default_model_path
    from pdserve.plan import read_kv_shape, read_weight_plan

    path = spec.engine.model_path or default_model_path()
    # NOTE: CPU workers: dtype and kv_dtype resolved as their engines resolve them (auto: float32)
    shape, cache = read_kv_shape(path), spec.engine.resolved("cpu")[0].cache
    block_bytes = cache.block_size * kv_bytes_per_token(shape.num_layers, shape.num_kv_heads, shape.head_dim,
                                                        cache.kv_dtype)
    gib = cache.kv_cache_gib if cache.kv_cache_gib is not None else CPU_KV_CACHE_GIB
    blocks = cache.num_blocks or max(1, int(gib * 2**30) // block_bytes)  # resolve_num_blocks on a CPU
    return Budget(read_weight_plan(path).bytes_resident, blocks * block_bytes)


def worker_rss() -> dict[str, int]:
    """Each worker actor's resident bytes, by its process title (Ray names an actor's process
    `ray::<class>`) and pid."""
    import psutil

    found = {}
    for process in psutil.process_iter(["pid", "cmdline"]):
        title = (process.info["cmdline"] or [""])[0]
        if title.startswith(("ray::PrefillWorker", "ray::DecodeWorker")):
            found[f"{title.split()[0].split('.')[0]}:{process.info['pid']}"] = process.memory_info().rss
    return found


def serve_requests(router: str, count: int) -> None:
    from pdserve.client import PdserveClient

    with PdserveClient(router) as client:
        for i in range(count):
            client.generate(f"{i}. {PROMPT}", temperature=0, max_tokens=32)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from bench.cluster import compare_on_cluster
    from deploy.config import ClusterSpec

    load_at_start = common.warn_if_busy(len(os.sched_getaffinity(0)))
    spec = ClusterSpec(port=0, http_port=0, namespace="bench-worker-memory")
    budget = budget_of(spec)

    def phases(sides: dict[str, Any]) -> dict[str, Any]:
        after_load = worker_rss()
        serve_requests(sides["router"], args.requests)
        return {"after_load": after_load, "after_requests": worker_rss()}

    rss = compare_on_cluster(spec, lambda _, address: {"router": _Address(address)}, phases)
    worst = max(max(rss["after_load"].values()), max(rss["after_requests"].values()))
    return {"rss_bytes": rss, "weight_bytes": budget.weight_bytes, "kv_pool_bytes": budget.kv_pool_bytes,
            "budget_bytes": budget.total, "worst_rss_ratio_to_budget": worst / budget.total,
            "requests": args.requests,
            "environment": {**common.environment(0), "loadavg_at_start": load_at_start}}


class _Address(str):
    """The router's address as a side compare_on_cluster can close."""

    def close(self) -> None:
        pass


def report(r: dict[str, Any]) -> str:
    mib = 2**20
    lines = [f"budget {r['budget_bytes'] / mib:,.0f} MiB = weights {r['weight_bytes'] / mib:,.0f} MiB x "
             f"{WEIGHT_FACTOR} + KV pool {r['kv_pool_bytes'] / mib:,.0f} MiB + {RUNTIME_ALLOWANCE_BYTES:,} B"]
    for phase, workers in r["rss_bytes"].items():
        for worker, rss in workers.items():
            share = rss / r["budget_bytes"]
            lines.append(f"{phase:15s} {worker:28s} {rss / mib:8,.0f} MiB  {share:.3f} of budget")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.worker_memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true",
                   help="one JSON object on stdout's last line (the table goes to stderr)")
    p.add_argument("--requests", type=int, default=16,
                   help="greedy requests (32 tokens each) served before the second reading (default 16)")
    return common.check_least(p, p.parse_args(argv), {"requests": 0})


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = run(args)
    common.publish(report(result), result, args.json)


if __name__ == "__main__":
    main()
