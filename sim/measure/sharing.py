"""What two workers' engines on one machine cost each other: `pdserve sim calibrate`'s pair measurement.

    measure_pair   two engine processes (each SmolLM2 with the cluster's EngineConfig at `threads`)
                   time a probe: the batch-1 and batch-4 decode steps (medians of PAIR_DECODE_STEPS)
                   and a PREFILL_TOKENS-token prefill. In each of `rounds` rounds engine 0 probes
                   alone while engine 1 waits, then both probe together; the ratio of engine 0's
                   medians, together ÷ alone, is what two workers on one machine cost each other.

Interleaving the two phases within the same two processes lets the machine's minute-to-minute
drift fall on both sides of the ratio alike, which a run alone followed by a run together does not.
Each engine runs in a spawned child process, so the parent's torch threads and memory do not count.

Not pure: its children load torch and the model, which is why it is only imported when a calibration
runs.
"""

from __future__ import annotations

import multiprocessing
import statistics
import time
from collections.abc import Callable
from typing import Any

PREFILL_TOKENS = 128
PAIR_ROUNDS, PAIR_DECODE_STEPS = 4, 10
CHILD_READY_S, CHILD_DONE_S = 300, 900  # model loading and warm-up; every round's probes


def _engine(threads: int) -> Any:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.sequence import SamplingParams

    engine = LLMEngine.from_config(EngineConfig(num_threads=threads), progress=False)
    warm_up = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.generate([list(range(1000, 1100))], warm_up, detokenize=False)
    return engine


def decode_step_ms(engine: Any, batch: int, steps: int) -> float:
    """The median of `steps` decode steps of `batch` 100-token sequences, in milliseconds."""
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


def prefill_ms(engine: Any) -> float:
    """One PREFILL_TOKENS-token prefill on an emptied cache, in milliseconds."""
    from pdserve.engine.sequence import SamplingParams

    engine.pool.reset_cache()
    engine.add_request([5000 + j for j in range(PREFILL_TOKENS)],
                       SamplingParams(max_tokens=1, ignore_eos=True), detokenize=False)
    start = time.perf_counter()
    engine.step()
    return (time.perf_counter() - start) * 1e3


def probe(engine: Any) -> dict[str, float]:
    return {"decode1_ms": decode_step_ms(engine, 1, PAIR_DECODE_STEPS),
            "decode4_ms": decode_step_ms(engine, 4, PAIR_DECODE_STEPS),
            "prefill_ms": prefill_ms(engine)}


def _pair_child(index: int, threads: int, rounds: int, ready: Any, barrier: Any, out: Any) -> None:
    """Rounds of two phases: engine 0 alone (engine 1 waits at the barrier), then both together."""
    engine = _engine(threads)
    ready.put(True)
    alone, together = [], []
    for _ in range(rounds):
        barrier.wait()
        if index == 0:
            alone.append(probe(engine))
        barrier.wait()
        together.append(probe(engine))
    out.put((index, alone, together))


def _run_pair(threads: int, rounds: int) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    """Engine 0's probes alone and together (see _pair_child)."""
    ctx = multiprocessing.get_context("spawn")
    ready, out, barrier = ctx.Queue(), ctx.Queue(), ctx.Barrier(2)
    children = [ctx.Process(target=_pair_child, args=(i, threads, rounds, ready, barrier, out), daemon=True)
                for i in range(2)]
    for c in children:
        c.start()
    for _ in children:  # model loading and warm-up are not timed
        ready.get(timeout=CHILD_READY_S)
    results = {i: (a, t) for i, a, t in (out.get(timeout=CHILD_DONE_S) for _ in children)}
    for c in children:
        c.join(timeout=30)
    return results[0]


def pair_ratios(alone: list[dict[str, float]], together: list[dict[str, float]],
                rounds: int) -> dict[str, Any]:
    """Each probe's median alone and together, and `<probe>_together_over_alone`."""
    medians = {which: {k: statistics.median(p[k] for p in probes) for k in probes[0]}
               for which, probes in (("alone", alone), ("together", together))}
    alone_ms, together_ms = medians["alone"], medians["together"]
    ratios = {f"{k}_together_over_alone": together_ms[k] / alone_ms[k] for k in alone_ms}
    return {**medians, "rounds": rounds, **ratios}


def measure_pair(threads: int, rounds: int = PAIR_ROUNDS,
                 say: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """The pair measurement (the module's docstring)."""
    say(f"pair: {rounds} rounds of one engine alone, then two together, {threads} torch thread(s) each")
    return pair_ratios(*_run_pair(threads, rounds), rounds)
