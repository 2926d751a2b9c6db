"""Two engines that differ in one kernel setting, alternating in one process: which is faster, per workload.

    python -m bench.kernel_ab [--json] [--setting NAME] [--values A B] [--threads N] [--reps N]
                              [--linear-kernel K] [--attention-kernel K] [--pointwise-kernel K]

Two LLMEngines over the same SmolLM2 weights (bench.engine's Ours), alike in every kernel flag but
--setting (an EngineConfig field: pointwise_kernel, attention_kernel or linear_kernel), which one
runs at A and the other at B. Per rep, on fresh seeded prompts, each side runs in turn:
  cold      a 2,048-token prompt on an emptied prefix cache       (bench.prefill_ttft's workloads:
  warm128   its 128 new tokens after 1,920 cached                   TTFT, seconds)
  suffix14  14 new tokens after the same 1,920 cached
  decode1   32 batch-1 decode steps after a 56-token prompt: seconds per step
  mixed32   bench.engine's 32 concurrent requests (its concurrent_mix: prompts of 32-512 tokens,
            16-128 new): seconds
The sizes are bench.engine's (SIZES: its FULL, with 33 tokens to decode).
Alternating rep by rep lets a drifting machine hit both sides alike, which two bench.engine runs
minutes apart do not (this machine's speed moved 14% between two of them on 2026-12-06). Reported:
medians over --reps, and A ÷ B per workload (above 1: B is faster).
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import replace
from typing import Any

from bench.common import (
    KERNEL_FLAGS,
    add_kernel_flags,
    bench_parser,
    check_least,
    environment,
    format_table,
    kernel_settings,
    run_timed,
    set_threads,
    warn_if_busy,
)
from bench.engine import (
    FULL,
    WARM_SUFFIX_TOKENS,
    Ours,
    Sizes,
    concurrent_mix,
    decode_tokens_per_s,
    kv_blocks_needed,
    random_prompt,
)
from bench.prefill_ttft import one_rep

WORKLOADS = ("cold", "warm128", "suffix14", "decode1", "mixed32")
SIZES = replace(FULL, decode_new_tokens=33)  # 32 decode steps after the prefill's token
DECODE_PROMPT_TOKENS = 56


def one_side(ours: Ours, rng: random.Random, sizes: Sizes) -> dict[str, float]:
    """Every workload once on this side; rng is seeded alike for both sides of a rep."""
    prompt = random_prompt(rng, sizes.warm_prompt_tokens)
    ttfts = one_rep(ours, prompt, sizes.warm_cached_tokens, WARM_SUFFIX_TOKENS, random_prompt(rng, 32))
    ours.reset()
    _, stamps, _ = ours.stream(random_prompt(rng, DECODE_PROMPT_TOKENS), sizes.decode_new_tokens)
    prompts, wants = concurrent_mix(rng, sizes)
    ours.reset()
    start = time.perf_counter()
    ours.generate(prompts, wants)
    mixed = time.perf_counter() - start
    return {"cold": ttfts["cold"], "warm128": ttfts["warm128"], "suffix14": ttfts["suffix14"],
            "decode1": 1 / decode_tokens_per_s(stamps), "mixed32": mixed}


def alternate(sides: dict[str, Ours], reps: int, sizes: Sizes,
              seed: int = 0) -> dict[str, dict[str, list[float]]]:
    """reps rounds, the sides' order swapped every round, each round on prompts of its own seed."""
    times: dict[str, dict[str, list[float]]] = {v: {w: [] for w in WORKLOADS} for v in sides}
    order = list(sides)
    for rep in range(reps):
        for value in (order if rep % 2 == 0 else order[::-1]):
            for workload, seconds in one_side(sides[value], random.Random(seed + rep), sizes).items():
                times[value][workload].append(seconds)
    return times


def run(args: Any) -> dict[str, Any]:
    from pdserve.engine.weights import load_model

    threads = set_threads(args.threads)
    load = warn_if_busy(threads)
    loaded = load_model(None, progress=False)
    base = kernel_settings(args)
    sides = {v: Ours(loaded, kv_blocks_needed(SIZES), SIZES.block_size, threads, **{**base, args.setting: v})
             for v in args.values}
    for ours in sides.values():
        ours.generate([random_prompt(random.Random(99), 64)], [4])  # warm-up
    times = alternate(sides, args.reps, SIZES)
    med = {v: {w: statistics.median(t) for w, t in d.items()} for v, d in times.items()}
    a, b = args.values
    return {"setting": args.setting, "values": args.values, "medians_s": med, "times_s": times,
            f"{a}_over_{b}": {w: med[a][w] / med[b][w] for w in WORKLOADS},
            "kernels": {k: v for k, v in base.items() if k != args.setting}, "threads": threads,
            "reps": args.reps, "loadavg_at_start": load, "environment": environment(threads)}


def report(r: dict[str, Any]) -> str:
    a, b = r["values"]
    rows = [[w, r["medians_s"][a][w] * 1e3, r["medians_s"][b][w] * 1e3, r[f"{a}_over_{b}"][w]]
            for w in WORKLOADS]
    head = f"{r['setting']}: {a} against {b}; other kernels {r['kernels']}; threads={r['threads']}"
    return "\n".join([head, format_table(["workload", f"{a} ms", f"{b} ms", f"{a} ÷ {b}"], rows)])


def main(argv: list[str] | None = None) -> None:
    p = bench_parser("python -m bench.kernel_ab", __doc__)
    p.add_argument("--setting", choices=KERNEL_FLAGS, default="pointwise_kernel",
                   help="the EngineConfig kernel field the two engines differ in (default: %(default)s)")
    p.add_argument("--values", nargs=2, metavar=("A", "B"), default=["torch", "avx2"],
                   help="its value on each side; ratios are A ÷ B (default: torch avx2)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: one per usable CPU core)")
    p.add_argument("--reps", type=int, default=3, help="alternating reps; medians (default: %(default)s)")
    add_kernel_flags(p)
    args = p.parse_args(argv)
    check_least(p, args, {"reps": 1})
    from pdserve.engine.config import ATTENTION_KERNELS, LINEAR_KERNELS, POINTWISE_KERNELS

    known = {"linear_kernel": LINEAR_KERNELS, "attention_kernel": ATTENTION_KERNELS,
             "pointwise_kernel": POINTWISE_KERNELS}[args.setting]
    for value in args.values:
        if value not in known:
            p.error(f"--values: {value!r} is not a {args.setting}; use {', '.join(known)}")
    run_timed(run, report, args)


if __name__ == "__main__":
    main()
