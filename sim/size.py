"""Sizing: which prefill:decode split and router policy serve a workload best under an SLO.

For N GPUs the candidates are colocated (N decode workers, every prompt prefilled where it
decodes) and every split p:(N - p), p = 1..N-1, each under every router policy. Each is simulated
on the same requests at the asked rate; for each:

    goodput_rps   requests/s that met the SLO one by one (TTFT <= ttft, their own p99 ITL <= itl):
                  loadtest/stats.py build_report's goodput, the load tester's definition
    slo_met       the run as a whole: TTFT p90 <= ttft_p90_ms and ITL p99 <= itl_p99_ms
    max_rate_rps  the highest rate (bisected) at which slo_met still holds: DistServe's goodput

best: the highest goodput_rps at the asked rate, ties broken by max_rate_rps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from loadtest.stats import SLO, build_report
from sim.cluster import ROUTING, ClusterShape, simulate
from sim.costs import CostModel
from sim.workload import SimRequest

Requests = Callable[[float], list[SimRequest]]  # rate -> the requests, arrivals at that rate
DEFAULT_SLO = {"ttft_p90_ms": 2000.0, "itl_p99_ms": 100.0}


@dataclass(frozen=True)
class SizingSLO:
    ttft_p90_ms: float = DEFAULT_SLO["ttft_p90_ms"]
    itl_p99_ms: float = DEFAULT_SLO["itl_p99_ms"]

    @classmethod
    def parse(cls, text: str) -> SizingSLO:
        """'ttft_p90_ms=500,itl_p99_ms=50' (either may be left out)."""
        values = dict(DEFAULT_SLO)
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            if not sep or key not in values:
                raise ValueError(f"--slo takes {','.join(f'{k}=MS' for k in DEFAULT_SLO)}, got {part!r}")
            values[key] = float(value)
        return cls(**values)

    def per_request(self) -> SLO:
        return SLO(self.ttft_p90_ms, self.itl_p99_ms, "p99")

    def met(self, report: dict[str, Any]) -> bool:
        ttft, itl = report["ttft_ms"]["p90"], report["itl_ms"]["p99"]
        return (report["counts"]["failed"] == 0 and ttft is not None and ttft <= self.ttft_p90_ms
                and (itl is None or itl <= self.itl_p99_ms))


def shapes(gpus: int, policies: Sequence[str] = ROUTING) -> list[ClusterShape]:
    if gpus < 2:
        raise ValueError(f"--gpus must be >= 2 to compare splits, got {gpus}")
    splits = [(0, gpus)] + [(p, gpus - p) for p in range(1, gpus)]
    return [ClusterShape(p, d, routing=r) for p, d in splits for r in policies]


def evaluate(shape: ClusterShape, requests: list[SimRequest], costs: CostModel, slo: SizingSLO,
             seed: int) -> dict[str, Any]:
    result = simulate(requests, shape, costs, seed)
    report = build_report(result.records, duration_s=result.duration_s, slo=slo.per_request())
    rate = len(requests) / max(requests[-1].arrival_s, 1e-9)
    return {"goodput_rps": round(report["goodput"]["fraction"] * rate, 3), "slo_met": slo.met(report),
            "ttft_p90_ms": report["ttft_ms"]["p90"], "itl_p99_ms": report["itl_ms"]["p99"],
            "refused": report["counts"]["failed"]}


def max_rate(shape: ClusterShape, make: Requests, costs: CostModel, slo: SizingSLO, rate: float,
             seed: int, steps: int = 6) -> float:
    """The highest rate at which the SLO holds, bisected between 0 and 4x the asked rate."""
    low, high = 0.0, 4 * rate
    for _ in range(steps):
        mid = (low + high) / 2
        if evaluate(shape, make(mid), costs, slo, seed)["slo_met"]:
            low = mid
        else:
            high = mid
    return round(low, 3)


def size(make: Requests, rate: float, gpus: int, costs: CostModel, slo: SizingSLO, seed: int = 0,
         policies: Sequence[str] = ROUTING, bisect: bool = True,
         progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    requests = make(rate)
    candidates = []
    for shape in shapes(gpus, policies):
        if progress:
            progress(f"{shape.label} {shape.routing}")
        row = {"split": shape.label, "prefill": shape.num_prefill, "decode": shape.num_decode,
               "colocated": shape.num_prefill == 0, "policy": shape.routing,
               **evaluate(shape, requests, costs, slo, seed)}
        if bisect:
            row["max_rate_rps"] = max_rate(shape, make, costs, slo, rate, seed)
        candidates.append(row)
    best = max(candidates, key=lambda c: (c["goodput_rps"], c.get("max_rate_rps", 0.0)))
    return {"rate_rps": rate, "gpus": gpus, "slo": vars(slo), "requests": len(requests),
            "costs": costs.source.get("note", ""), "best": best, "candidates": candidates}


def goodput_curve(make: Requests, shape: ClusterShape, costs: CostModel, slo: SizingSLO,
                  rates: Sequence[float], seed: int = 0) -> list[float]:
    return [evaluate(shape, make(r), costs, slo, seed)["goodput_rps"] for r in rates]
