"""Two measurements behind the simulator's validation (docs/simulator.md): is this machine steady,
and do two workers' engines slow each other down on it?

    python -m bench.sim_diagnostics drift [--probes N] [--every S] [--threads T] [--json]
    python -m bench.sim_diagnostics pair [--threads T] [--json]

drift  one in-process engine (SmolLM2, the cluster's EngineConfig at --threads) times a 128-token
       prefill and the median batch-1 decode step of 10, --probes times, --every seconds apart, on
       an otherwise idle machine: how far the machine's speed moves from minute to minute, which
       bounds how closely any cost file calibrated at one moment can predict a run at another.
pair   the batch-1 decode step, the batch-4 decode step (medians of 30) and a 128-token prefill
       (median of 3), first in one engine process alone, then in two engine processes started
       together (each at --threads): what two workers on one machine cost each other, with nothing
       else running.

Each engine runs in a child process of its own (spawned), so the parent's torch threads and memory
do not count. Ratios are together ÷ alone, and max ÷ min over the drift probes.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import time
from typing import Any

from bench.common import environment, progress

PREFILL_TOKENS = 128
DECODE_STEPS = 30


def _engine(threads: int) -> Any:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.sequence import SamplingParams

    engine = LLMEngine.from_config(EngineConfig(num_threads=threads), progress=False)
    warm_up = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.generate([list(range(1000, 1100))], warm_up, detokenize=False)
    return engine


def _decode_step_ms(engine: Any, batch: int, steps: int = DECODE_STEPS) -> float:
    from pdserve.engine.sequence import SamplingParams

    engine.pool.reset_cache()
    for i in range(batch):
        engine.add_request([3000 + 11 * i + j for j in range(100)],
                           SamplingParams(max_tokens=steps + 1, ignore_eos=True), detokenize=False)
    engine.step()  # the prefill
    times = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _prefill_ms(engine: Any, reps: int = 3) -> float:
    from pdserve.engine.sequence import SamplingParams

    times = []
    for i in range(reps):
        engine.pool.reset_cache()
        engine.add_request([5000 + 13 * i + j for j in range(PREFILL_TOKENS)],
                           SamplingParams(max_tokens=1, ignore_eos=True), detokenize=False)
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _drift_child(threads: int, probes: int, every_s: float, out: Any) -> None:
    engine = _engine(threads)
    rows = []
    for _ in range(probes):
        rows.append({"at": time.strftime("%H:%M:%S"), "prefill_ms": _prefill_ms(engine, reps=1),
                     "decode_step_ms": _decode_step_ms(engine, 1, steps=10)})
        time.sleep(every_s)
    out.put(rows)


def _pair_child(threads: int, ready: Any, go: Any, out: Any) -> None:
    engine = _engine(threads)
    ready.put(True)
    go.wait()
    out.put({"decode1_ms": _decode_step_ms(engine, 1), "decode4_ms": _decode_step_ms(engine, 4),
             "prefill_ms": _prefill_ms(engine)})


def _run_together(threads: int, count: int) -> list[dict[str, float]]:
    ctx = multiprocessing.get_context("spawn")
    ready, out, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    children = [ctx.Process(target=_pair_child, args=(threads, ready, go, out), daemon=True)
                for _ in range(count)]
    for c in children:
        c.start()
    for _ in children:  # model loading and warm-up are not timed; the timed parts start together
        ready.get(timeout=300)
    go.set()
    results = [out.get(timeout=600) for _ in children]
    for c in children:
        c.join(timeout=30)
    return results


def drift(args: argparse.Namespace) -> dict[str, Any]:
    progress(f"drift: {args.probes} probes, {args.every} s apart, {args.threads} torch thread(s)")
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=_drift_child, args=(args.threads, args.probes, args.every, out), daemon=True)
    child.start()
    rows = out.get(timeout=600 + args.probes * (args.every + 10))
    child.join(timeout=30)
    pre, dec = [r["prefill_ms"] for r in rows], [r["decode_step_ms"] for r in rows]
    return {"probes": rows, "prefill_ms_min": min(pre), "prefill_ms_max": max(pre),
            "prefill_max_over_min": max(pre) / min(pre), "decode_step_ms_min": min(dec),
            "decode_step_ms_max": max(dec), "decode_max_over_min": max(dec) / min(dec)}


def pair(args: argparse.Namespace) -> dict[str, Any]:
    progress(f"pair: one engine alone, {args.threads} torch thread(s)")
    alone = _run_together(args.threads, 1)[0]
    progress("pair: two engines together")
    together = _run_together(args.threads, 2)
    ratios = {f"{k}_together_over_alone": max(t[k] for t in together) / alone[k] for k in alone}
    return {"alone": alone, "together": together, **ratios}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.sim_diagnostics", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("drift", help="how far this machine's speed moves from minute to minute")
    d.add_argument("--probes", type=int, default=12, help="timed probes (default: %(default)s)")
    d.add_argument("--every", type=float, default=8.0, help="seconds between probes (default: %(default)s)")
    q = sub.add_parser("pair", help="what two engines on this machine cost each other")
    for s in (d, q):
        s.add_argument("--threads", type=int, default=1,
                       help="torch threads of each engine, as each of two workers gets "
                            "(default: %(default)s)")
        s.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    if args.threads < 1 or getattr(args, "probes", 1) < 1 or getattr(args, "every", 0) < 0:
        p.error("--threads and --probes must be >= 1 and --every >= 0")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    measured = drift(args) if args.command == "drift" else pair(args)
    result = {**measured, "environment": environment(args.threads)}
    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps({k: v for k, v in result.items() if k not in ("probes", "environment")}, indent=2))


if __name__ == "__main__":
    main()
