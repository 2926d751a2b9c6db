"""Goodput against rate for the best candidates of a sizing run (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sim.cluster import ClusterShape
from sim.costs import CostModel
from sim.size import Requests, SizingSLO, goodput_curve

RATE_FACTORS = (0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0)


def plot_goodput(
    sizing: dict[str, Any],
    make: Requests,
    costs: CostModel,
    slo: SizingSLO,
    path: Path,
    seed: int = 0,
    top: int = 3,
) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranked = sorted(
        sizing["candidates"], key=lambda c: (c["goodput_rps"], c.get("max_rate_rps", 0)), reverse=True
    )
    chosen = ranked[:top]
    if not any(c["colocated"] for c in chosen):  # always show colocated, the baseline
        chosen.append(next(c for c in ranked if c["colocated"]))
    rates = [sizing["rate_rps"] * f for f in RATE_FACTORS]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for c in chosen:
        shape = ClusterShape(c["prefill"], c["decode"], routing=c["policy"])
        ax.plot(
            rates,
            goodput_curve(make, shape, costs, slo, rates, seed),
            marker="o",
            label=f"{c['split']} {c['policy']}",
        )
    ax.plot(rates, rates, ls=":", c="grey", label="offered rate")
    ax.set_xlabel("offered rate (requests/s)")
    ax.set_ylabel("goodput (requests/s within the SLO)")
    ax.set_title(
        f"{sizing['gpus']} workers, TTFT p90 <= {slo.ttft_p90_ms:g} ms, ITL p99 <= {slo.itl_p99_ms:g} ms"
    )
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return str(path)
