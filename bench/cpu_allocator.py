"""Prefill time with freed memory kept in the process (EngineConfig.retain_freed_memory) and without.

    python -m bench.cpu_allocator [--json] [--threads N] [--reps N] [--linear-kernel K]
                                  [--attention-kernel A]

glibc's thresholds are process-wide and cannot be set back, so each side runs in a process of its
own: per rep, one child process with retain_freed_memory True and one with False, in alternating
order, so a drifting machine hits both alike. A child loads SmolLM2, builds bench.engine's Ours,
runs the workloads below once untimed (the first touch of every buffer, which both sides pay), then
twice timed (one_rep): cold (2,048 tokens, nothing cached), warm128 (128 new tokens after 1,920
cached) and suffix14 (14 after 1,920). It reports each workload's faster rep, the minor page faults of
its timed reps (getrusage) and its resident memory at the end. Reported: medians over --reps of each
side, and off ÷ on per workload (above 1: keeping freed memory is faster).
"""

from __future__ import annotations

import json
import random
import resource
import statistics
import subprocess
import sys
from typing import Any

from bench.common import (
    add_kernel_flags,
    add_threads_flag,
    bench_parser,
    check_least,
    environment,
    format_table,
    kernel_argv,
    kernel_settings,
    progress,
    run_timed,
    set_threads,
    warn_if_busy,
)

SIDES = ("on", "off")
WORKLOADS = ("cold", "warm128", "suffix14")
PROMPT, CACHED, SUFFIX = 2048, 1920, 14  # bench.engine's cold, warm and suffix TTFT prompts


def one_rep(ours: Any, prompt: list[int], cached: int, suffix: int, other: list[int]) -> dict[str, float]:
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


def resident_mib() -> float:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmRSS"))
    return int(line.split()[1]) / 1024


def child(side: str, threads: int, kernels: dict[str, str], seed: int) -> dict[str, Any]:
    """One side in this process: its workloads' times, page faults and resident memory."""
    from bench.engine import Ours, random_prompt
    from pdserve.engine.weights import load_model

    set_threads(threads)
    ours = Ours(load_model(None, progress=False), 2 * (PROMPT // 16) + 16, 16, threads, **kernels,
                retain_freed_memory=side == "on")
    rng = random.Random(seed)
    prompt = random_prompt(rng, PROMPT)
    one_rep(ours, prompt, CACHED, SUFFIX, random_prompt(rng, 32))  # untimed: every buffer's first touch
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    reps = [one_rep(ours, prompt, CACHED, SUFFIX, random_prompt(rng, 32)) for _ in range(2)]
    return {"seconds": {w: min(r[w] for r in reps) for w in WORKLOADS},
            "minor_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults,
            "resident_mib": resident_mib()}


def run_child(side: str, args: Any, threads: int, seed: int) -> dict[str, Any]:
    command = [sys.executable, "-m", "bench.cpu_allocator", "--child", side, "--threads", str(threads),
               *kernel_argv(args), "--seed", str(seed)]
    out = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(args: Any) -> dict[str, Any]:
    threads = set_threads(args.threads)
    load = warn_if_busy(threads)
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    for rep in range(args.reps):
        for side in (SIDES if rep % 2 == 0 else SIDES[::-1]):
            progress(f"rep {rep + 1}/{args.reps}: retain_freed_memory {side}")
            runs[side].append(run_child(side, args, threads, seed=rep))
    med = {side: {w: statistics.median(r["seconds"][w] for r in runs[side]) for w in WORKLOADS}
           for side in SIDES}
    def median_of(key: str) -> dict[str, float]:
        return {side: statistics.median(r[key] for r in runs[side]) for side in SIDES}

    return {"medians_s": med, "runs": runs,
            "off_over_on": {w: med["off"][w] / med["on"][w] for w in WORKLOADS},
            "minor_faults": median_of("minor_faults"), "resident_mib": median_of("resident_mib"),
            **kernel_settings(args), "threads": threads, "reps": args.reps, "loadavg_at_start": load,
            "environment": environment(threads)}


def report(r: dict[str, Any]) -> str:
    rows = [[w, r["medians_s"]["on"][w] * 1e3, r["medians_s"]["off"][w] * 1e3, r["off_over_on"][w]]
            for w in WORKLOADS]
    rows.append(["minor page faults, 2 timed reps", r["minor_faults"]["on"], r["minor_faults"]["off"], ""])
    rows.append(["resident MiB at the end", r["resident_mib"]["on"], r["resident_mib"]["off"], ""])
    return format_table(["workload", "retained ms", "given back ms", "given back ÷ retained"], rows)


def main(argv: list[str] | None = None) -> None:
    p = bench_parser("python -m bench.cpu_allocator", __doc__)
    add_threads_flag(p)
    p.add_argument("--reps", type=int, default=3,
                   help="child processes per side, alternating; medians (default: %(default)s)")
    add_kernel_flags(p)
    p.add_argument("--child", choices=SIDES, help="(internal) run one side in this process, print its JSON")
    p.add_argument("--seed", type=int, default=0, help="(internal, with --child) the prompt's seed")
    args = check_least(p, p.parse_args(argv), {"reps": 1})
    if args.child:
        print(json.dumps(child(args.child, set_threads(args.threads), kernel_settings(args), args.seed)))
        return
    run_timed(run, report, args)


if __name__ == "__main__":
    main()
