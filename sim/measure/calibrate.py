"""`pdserve sim calibrate`: fit sim/costs.py's coefficients from runs on this machine.

    steps     the real engine (LLMEngine over SmolLM2, the cluster's own EngineConfig defaults, at the
              torch threads of the workers it stands for: --threads) runs
              prefills of (new tokens x cached tokens) and decode batches of (batch size x context);
              every step is timed with the chunks it ran, and the step formula of sim/costs.py is
              fitted to them by least squares with non-negative coefficients: a token curve (the
              step's cost by the rows its matmuls multiply, at CURVE_KNOTS) plus the attention terms
              (fit_step_costs)
    sharing   sim/measure/sharing.py's pair measurement (not with --quick): two engine processes
              stepping together against one alone; the mean of its three ratios, less 1, is the
              step's shared_machine_slowdown (sim/costs.py)
    transfer  sim/measure/wire.py's gRPC push of a small and a large KV payload between two processes:
              bandwidth from the large one, per-frame latency from what the small one took beyond
              its bytes / bandwidth
    hardware  bytes per token and blocks per worker from the model's config and CacheConfig

Not pure: it loads torch and the model, which is why it is only imported when the command runs.
"""

from __future__ import annotations

import platform
import sys
import time
from dataclasses import replace
from typing import Any

import numpy as np
from tqdm import tqdm

from pdserve.engine.config import EngineConfig, SchedulerConfig
from pdserve.engine.scheduler import StepShape
from pdserve.engine.sequence import SamplingParams
from sim.costs import CostModel, Hardware, StepCosts, TransferCosts

PREFILL_GRID = [(n, c) for n in (32, 128, 384) for c in (0, 256)]  # (new tokens, cached tokens)
# (batch, context per sequence): every decode batch size is a knot of the token curve below
DECODE_GRID = [(b, ctx) for b in (1, 2, 4, 8) for ctx in (64, 448)] + [(16, 64)]
# --quick (the suite's calibration): the long contexts at batch 1 and 2 only; 4 x 448 and 8 x 448 cost
# 5,376 prompt tokens of prefill (~18 s at 1 thread) and add no knot
QUICK_DECODE_GRID = [g for g in DECODE_GRID if g[1] == 64 or g[0] <= 2]
WIRE_MIB = (4, 32)  # whole 4 MiB float32 blocks of make_pool


def calibrate(threads: int, quick: bool = False, progress: bool = True) -> CostModel:
    """`threads`: the torch threads of the workers the costs are for (a step at 1 thread on this CPU
    takes about twice one at 2); recorded in the file's source as torch_threads."""
    from pdserve.engine.llm_engine import LLMEngine

    config = EngineConfig(num_threads=threads)
    engine = LLMEngine.from_config(config, progress=False)
    rows, times = _measure_steps(engine, QUICK_DECODE_GRID if quick else DECODE_GRID, reps=1 if quick else 2,
                                 progress=progress)
    step, relative = fit_step_costs(rows, times)
    sharing = None if quick else _measure_sharing(threads, progress)
    if sharing is not None:
        step = replace(step, shared_machine_slowdown=sharing["slowdown"])
    model = engine.model_config
    cache = engine.config.cache  # NOTE: the engine's, its kv_dtype resolved (auto: the model's dtype)
    hw = Hardware(
        model.kv_bytes_per_token(cache.kv_dtype),
        model.num_layers,
        cache.resolve_num_blocks(model),
        cache.block_size,
        SchedulerConfig().max_num_batched_tokens,
        SchedulerConfig().max_num_seqs,
        workers_per_machine=1 if quick else 2,  # the pair measurement's two engines
    )
    transfer = measure_transfer(progress)
    source = {
        "note": "measured on this machine by `pdserve sim calibrate`",
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "torch_threads": threads,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "steps": len(rows),
        "fit_relative_error_median": round(float(np.median(relative)), 3),
        "fit_relative_error_p90": round(float(np.percentile(relative, 90)), 3),
        "samples": {"columns": list(SAMPLE_COLUMNS), "rows": rows, "step_s": times},
        "load_average": list(_loadavg()),
        "shared_machine": sharing or "not measured (--quick): shared_machine_slowdown left at 0",
    }
    return CostModel(step, transfer, hw, source)


SAMPLE_COLUMNS = ("prefill_tokens", "prefill_attn/1000", "decode_seqs", "decode_context/1000")
# The token curve's knots (rows a step multiplies): where the calibration grid puts steps, so each
# knot is pinned by samples on both sides (decode batches of 1-16 rows, prefills of 32-2048).
CURVE_KNOTS = (1, 2, 4, 8, 16, 32, 128, 384, 1024, 2048)


def features(shape: StepShape) -> list[float]:
    """A step's SAMPLE_COLUMNS, from what it computed (LLMEngine.last_step, or a worker's step trace)."""
    return [
        sum(n for n, _ in shape.prefill),
        sum(n * (c + n / 2) for n, c in shape.prefill) / 1000,
        shape.decode_seqs,
        shape.decode_context / 1000,
    ]


def fit_step_costs(samples: list[list[float]], times: list[float],
                   knots: tuple[int, ...] = CURVE_KNOTS) -> tuple[StepCosts, np.ndarray]:
    """sim/costs.py's step formula with a token curve, fitted to timed steps (SAMPLE_COLUMNS each):
    the curve's value at every knot, prefill_attn_s and decode_context_s, by least squares with
    every coefficient >= 0, and the spread (each step's time ÷ the fit's, sorted). Returns the costs
    and each step's relative error.

    NOTE: weighted by 1/time, so the fit minimises relative error: a 40 ms decode step counts as
    much as a 5 s prefill, else the long prefills decide every coefficient and decode is lost.
    """
    rows = [int(n + b) for n, _, b, _ in samples]
    # a knot no step weighs on would come out 0 and bend the curve there: fit only the pinned ones
    knots = tuple(k for j, k in enumerate(knots) if any(curve_weights(r, knots)[j] for r in rows))
    x = np.array([[*curve_weights(r, knots), attn, ctx] for r, (_, attn, _, ctx) in zip(rows, samples)])
    y = np.array(times)
    coef = nonnegative_lstsq(x / y[:, None], np.ones_like(y))
    curve = tuple((k, float(v)) for k, v in zip(knots, coef[:len(knots)]))
    fitted = x @ coef
    spread = tuple(round(float(r), 4) for r in sorted(y[fitted > 0] / fitted[fitted > 0]))
    step = StepCosts(0.0, 0.0, prefill_attn_s=float(coef[-2]), decode_context_s=float(coef[-1]),
                     token_curve=curve, spread=spread)
    return step, np.abs(fitted - y) / y


def curve_weights(rows: int, knots: tuple[int, ...]) -> list[float]:
    """The weights of each knot's value in StepCosts.curve_s(rows): the curve is linear in them."""
    w = [0.0] * len(knots)
    if rows <= knots[0]:
        w[0] = 1.0
        return w
    i = next((j for j, k in enumerate(knots) if k >= rows), len(knots) - 1)  # the segment ending at i
    t = (rows - knots[i - 1]) / (knots[i] - knots[i - 1])
    w[i - 1], w[i] = 1 - t, t  # t > 1 past the last knot: extrapolation along the last segment
    return w


def _measure_steps(engine, decode_grid: list[tuple[int, int]], reps: int,
                   progress: bool) -> tuple[list[list[float]], list[float]]:
    """Run the grids through engine.step(), timing each step with what it computed."""
    engine.generate(
        [list(range(1000, 1064))], SamplingParams(max_tokens=4, ignore_eos=True), detokenize=False
    )  # warm-up: the first steps pay for torch's lazy set-up
    rows, times = [], []
    jobs = [("prefill", g) for g in PREFILL_GRID] + [("decode", g) for g in decode_grid]
    rng = np.random.default_rng(0)
    for kind, (a, b) in tqdm(jobs * reps, desc="calibrate: engine steps", disable=not progress):
        engine.pool.reset_cache()
        if kind == "prefill":
            prefix = rng.integers(1000, 30000, b).tolist()
            if b:
                engine.generate(
                    [prefix + [5]], SamplingParams(max_tokens=1, ignore_eos=True), detokenize=False
                )
            prompts = [prefix + rng.integers(1000, 30000, a).tolist()]
            sampling = SamplingParams(max_tokens=1, ignore_eos=True)
        else:
            prompts = [rng.integers(1000, 30000, b).tolist() for _ in range(a)]
            sampling = SamplingParams(max_tokens=8, ignore_eos=True)
        for p in prompts:
            engine.add_request(p, sampling, detokenize=False)
        while engine.has_unfinished():
            t0 = time.perf_counter()
            engine.step()
            elapsed = time.perf_counter() - t0
            if engine.last_step is not None:
                rows.append(features(engine.last_step))
                times.append(elapsed)
    return rows, times


def nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: refit without the columns that came out negative."""
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            return coef
        active = [a for a, s in zip(active, sol) if s >= 0]
    return coef


def measure_transfer(progress: bool) -> TransferCosts:
    from sim.measure.wire import MIB, push_seconds

    seconds = {mib: push_seconds(mib, "float32", reps=3, chunk_bytes=2 * MIB)
               for mib in tqdm(WIRE_MIB, desc="calibrate: KV transfer (gRPC)", disable=not progress)}
    bandwidth = WIRE_MIB[-1] * MIB / seconds[WIRE_MIB[-1]]
    frames = 32  # sim.measure.wire.make_pool's layers: one frame per layer at least
    latency = max(0.0, (seconds[WIRE_MIB[0]] - WIRE_MIB[0] * MIB / bandwidth) / frames)
    return TransferCosts(bandwidth, latency)


def _measure_sharing(threads: int, progress: bool) -> dict[str, Any]:
    from sim.measure.sharing import measure_pair

    pair = measure_pair(threads, say=_say if progress else lambda _: None)
    ratios = {k: round(v, 3) for k, v in pair.items() if k.endswith("_together_over_alone")}
    return {"slowdown": round(max(0.0, float(np.mean(list(ratios.values()))) - 1), 3), **ratios}


def _say(line: str) -> None:
    """A progress line on stderr, between the progress bars."""
    tqdm.write(f"calibrate: {line}", file=sys.stderr)


def _loadavg() -> tuple[float, float, float]:
    import os

    return os.getloadavg()
