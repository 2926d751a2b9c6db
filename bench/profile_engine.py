"""Where an engine step's time goes: torch.profiler's self CPU time per op, in docs/benchmarks.md's groups.

    python -m bench.profile_engine [--json] [--threads N] [--linear-kernel K] [--attention-kernel K]
                                   [--only NAME]

Steps SmolLM2's LLMEngine (bench.engine's Ours) through six workloads and profiles them:
  decode1   16 batch-1 decode steps after a 40-token prompt
  decode32  10 decode steps of 32 sequences of 32-512 context tokens
  suffix    one prefill of 14 new tokens after 544 cached ones
  suffix1920  one prefill of 14 new tokens after 1,920 cached ones (bench.engine's suffix)
  warm128   one prefill of 128 new tokens after 1,920 cached ones (bench.engine's warm TTFT)
  cold2048  one prefill of a 2,048-token prompt on an empty cache (bench.engine's cold TTFT)
Each op's self CPU time is put in one group: matmuls (aten::mm, oneDNN's linear, pdserve::gemv and
pdserve::panel_matmul),
KV gather (index_select), attention (scaled_dot_product*, pdserve::paged_*_attention), KV write
(index_put*), everything else. Reported: each group's share of the profiled op time, and its
milliseconds per profiled step (op time only: Python between ops is in neither).
"""

from __future__ import annotations

import random
from typing import Any

from bench.common import add_kernel_flags, bench_parser, format_table, kernel_settings, publish, set_threads
from bench.engine import Ours, random_prompt

GROUPS = {"matmuls": ("aten::mm", "aten::addmm", "mkldnn::_linear_pointwise", "pdserve::gemv",
                      "pdserve::panel_matmul"),
          "kv_gather": ("aten::index_select",),
          "attention": ("aten::_scaled_dot_product", "pdserve::paged_decode_attention",
                        "pdserve::paged_prefill_attention"),
          "kv_write": ("aten::index_put", "aten::_index_put")}


WORKLOADS = ("decode1", "decode32", "suffix", "suffix1920", "warm128", "cold2048")
ALL_GROUPS = (*GROUPS, "everything_else")


def group_of(op: str) -> str:
    return next((g for g, prefixes in GROUPS.items() if op.startswith(prefixes)), "everything_else")


def group_ms(profile: Any, steps: int) -> dict[str, float]:
    """Each group's self CPU milliseconds per profiled step."""
    totals = dict.fromkeys(ALL_GROUPS, 0.0)
    for event in profile.key_averages():
        totals[group_of(event.key)] += event.self_cpu_time_total / 1e3 / steps  # profiler: microseconds
    return totals


def shares(ms: dict[str, float]) -> dict[str, float]:
    whole = sum(ms.values()) or 1.0
    return {g: ms[g] / whole for g in ALL_GROUPS}


def profiled(ours: Ours, steps: int) -> dict[str, Any]:
    """The next `steps` engine steps, profiled; then the engine is run dry."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as p:
        for _ in range(steps):
            ours.engine.step()
    while ours.engine.has_unfinished():
        ours.engine.step()
    ms = group_ms(p, steps)
    return {**shares(ms), "ms_per_step": ms}


def prepare(ours: Ours, name: str, rng: random.Random) -> int:
    """Queue workload `name` on an emptied cache; how many steps to profile."""
    add = lambda ids, n: ours.engine.add_request(ids, ours.greedy(n), detokenize=False)  # noqa: E731
    ours.reset()
    if name == "decode1":
        add(random_prompt(rng, 40), 40)
        ours.engine.step()  # the prefill
        return 16
    if name == "decode32":
        for _ in range(32):
            add(random_prompt(rng, rng.randint(32, 512)), 30)
        for _ in range(8):  # past the prefills
            ours.engine.step()
        return 10
    if name == "cold2048":
        add(random_prompt(rng, 2048), 1)
        return 1
    cached, new = {"suffix": (544, 14), "suffix1920": (1920, 14), "warm128": (1920, 128)}[name]
    prompt = random_prompt(rng, cached + new)
    ours.ttft(prompt[:cached] + random_prompt(rng, 32))  # `cached` tokens cached, whole blocks
    add(prompt, 1)
    return 1


def run(args: Any) -> dict[str, Any]:
    from pdserve.engine.weights import load_model

    threads = set_threads(args.threads)
    ours = Ours(load_model(None, progress=False), 2048, 16, threads, **kernel_settings(args))
    rng = random.Random(0)
    ours.generate([random_prompt(rng, 64)], [4])  # warm-up
    result: dict[str, Any] = {"threads": threads, **kernel_settings(args)}
    for name in [args.only] if args.only else WORKLOADS:
        result[name] = profiled(ours, prepare(ours, name, rng))
    return result


def report(r: dict[str, Any]) -> str:
    names = [k for k in WORKLOADS if k in r]
    rows = [[name, *(f"{100 * r[name][g]:.1f}% ({r[name]['ms_per_step'][g]:.1f} ms)" for g in ALL_GROUPS),
             f"{sum(r[name]['ms_per_step'].values()):.1f} ms"] for name in names]
    return format_table(["workload", *ALL_GROUPS, "op time a step"], rows)


def main(argv: list[str] | None = None) -> None:
    p = bench_parser("python -m bench.profile_engine", __doc__)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default: %(default)s)")
    p.add_argument("--only", choices=WORKLOADS, help="profile one workload only")
    add_kernel_flags(p)
    args = p.parse_args(argv)
    result = run(args)
    publish(report(result), result, args.json)


if __name__ == "__main__":
    main()
