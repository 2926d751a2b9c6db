"""Time to first token of a prefill under each attention kernel, the two alternating in one process.

    python -m bench.prefill_ttft [--json] [--threads N] [--reps N] [--linear-kernel K]

Two LLMEngines over the same SmolLM2 weights (bench.engine's Ours), one with attention_kernel sdpa
(torch's SDPA; a chunk after cached tokens gathers its context and masks) and one with avx2
(pdserve's paged kernels), both on --linear-kernel. Per rep, on a fresh seeded 2,048-token prompt,
each side runs in turn:
  cold      the whole prompt on an emptied prefix cache (bench.engine's cold TTFT)
  warm128   the prompt after its first 1,920 tokens were cached by an earlier request (bench.engine's
            warm TTFT: 128 new tokens)
  suffix14  its first 1,934 tokens after the same 1,920 cached (bench.engine's 14-token suffix)
Alternating rep by rep lets a drifting machine hit both sides alike, which two bench.engine runs
minutes apart do not. Reported: medians over --reps, sdpa ÷ avx2 per workload (above 1: the paged
kernel is faster), and each side's warm ÷ cold (bench.engine's warm_ttft_ratio).
"""

from __future__ import annotations

import random
import statistics
from typing import Any

from bench.common import (
    LINEAR_KERNEL_HELP,
    bench_parser,
    check_least,
    environment,
    format_table,
    publish,
    set_threads,
    warn_if_busy,
)
from bench.engine import Ours, random_prompt

KERNELS = ("avx2", "sdpa")
PROMPT, CACHED, SUFFIX = 2048, 1920, 14
WORKLOADS = ("cold", "warm128", "suffix14")


def one_rep(ours: Ours, prompt: list[int], cached: int, suffix: int, other: list[int]) -> dict[str, float]:
    """Each workload's TTFT on this side, the cache emptied before each; `other` tokens end the
    request that caches the prompt's first `cached` (whole blocks) before the warm workloads."""
    def timed(ids: list[int], hit: int) -> float:
        seconds, usage = ours.ttft(ids)
        assert usage.cached_tokens == hit, f"{len(ids)} tokens found {usage.cached_tokens} cached, not {hit}"
        return seconds

    def after_cached(ids: list[int]) -> float:
        ours.reset()
        ours.ttft(prompt[:cached] + other)
        return timed(ids, cached)

    ours.reset()
    return {"cold": timed(prompt, 0), "warm128": after_cached(prompt),
            "suffix14": after_cached(prompt[:cached + suffix])}


def run(args: Any) -> dict[str, Any]:
    from pdserve.engine.weights import load_model

    threads = set_threads(args.threads)
    load = warn_if_busy(threads)
    loaded = load_model(None, progress=False)
    blocks = 2 * (PROMPT // 16) + 16
    sides = {k: Ours(loaded, blocks, 16, threads, linear_kernel=args.linear_kernel, attention_kernel=k)
             for k in KERNELS}
    rng = random.Random(0)
    for ours in sides.values():
        ours.generate([random_prompt(rng, 64)], [4])  # warm-up
    times: dict[str, dict[str, list[float]]] = {k: {w: [] for w in WORKLOADS} for k in KERNELS}
    for _ in range(args.reps):
        prompt = random_prompt(rng, PROMPT)
        for kernel, ours in sides.items():
            for workload, seconds in one_rep(ours, prompt, CACHED, SUFFIX, random_prompt(rng, 32)).items():
                times[kernel][workload].append(seconds)
    med = {k: {w: statistics.median(v) for w, v in d.items()} for k, d in times.items()}
    return {"medians_s": med, "times_s": times,
            "sdpa_over_avx2": {w: med["sdpa"][w] / med["avx2"][w] for w in WORKLOADS},
            "warm_ttft_ratio": {k: med[k]["warm128"] / med[k]["cold"] for k in KERNELS},
            "linear_kernel": args.linear_kernel, "threads": threads, "reps": args.reps,
            "loadavg_at_start": load, "environment": environment(threads)}


def report(r: dict[str, Any]) -> str:
    rows = [[w, r["medians_s"]["sdpa"][w] * 1e3, r["medians_s"]["avx2"][w] * 1e3, r["sdpa_over_avx2"][w]]
            for w in WORKLOADS]
    rows.append(["warm128 ÷ cold", r["warm_ttft_ratio"]["sdpa"], r["warm_ttft_ratio"]["avx2"], ""])
    return format_table(["workload", "sdpa ms", "avx2 ms", "sdpa ÷ avx2"], rows)


def main(argv: list[str] | None = None) -> None:
    from pdserve.engine.config import LINEAR_KERNELS

    p = bench_parser("python -m bench.prefill_ttft", __doc__)
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: one per usable CPU core)")
    p.add_argument("--reps", type=int, default=5, help="alternating reps; medians (default: %(default)s)")
    p.add_argument("--linear-kernel", choices=LINEAR_KERNELS, default="avx2", help=LINEAR_KERNEL_HELP)
    args = p.parse_args(argv)
    check_least(p, args, {"reps": 1})
    result = run(args)
    publish(report(result), result, args.json)


if __name__ == "__main__":
    main()
