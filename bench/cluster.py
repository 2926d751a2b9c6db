"""What the cluster's hops add: the same requests through `pdserve up`'s cluster and in-process.

    python -m bench.cluster [--json] [--quick] [--reps N] [--prompt-tokens N] [--new-tokens N] [--batch N]
                            [--threads N]

Cluster: LocalCluster (what `pdserve up` starts: embedded Redis, local Ray, the router in this
process) with 0 prefill and 1 decode worker, so every prompt is prefilled on the decode worker;
the worker gets every core as torch threads, as `pdserve up` gives a lone worker (--threads: fewer,
as `pdserve up --torch-threads`). Driven through
the public gRPC client, timed on the client side.
In-process: an LLMEngine in a process of its own with the worker's cache, scheduler and thread
count, stepped directly; each token is timed as the step that produced it returns.

  ttft   a fresh random prompt of --prompt-tokens token ids, max_tokens=1: client call to the
         first token, against add_request to the first token
  itl    --batch streams at once, each a fresh prompt of 32 tokens and --new-tokens greedy tokens:
         the median gap between consecutive tokens of a stream, against the engine's median step
         time with the same streams decoding

Headlines: ttft_overhead = cluster TTFT ÷ in-process TTFT and itl_overhead = cluster ITL ÷
in-process step time (targets ≤ 1.10 each, issue 15), at batch 1 and at --batch. The two sides
alternate rep by rep; medians over reps after a warm-up. Greedy tokens of both sides are compared.
"""

from __future__ import annotations

import os
import random
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any
from unittest import mock

from bench import common
from bench.engine import random_prompt

TARGET_OVERHEAD = 1.10
ITL_PROMPT_TOKENS = 32


@dataclass(frozen=True)
class Sizes:
    prompt_tokens: int = 512
    new_tokens: int = 64
    batch: int = 4
    reps: int = 3


QUICK = Sizes(prompt_tokens=128, new_tokens=12, batch=2, reps=1)


def median_gap(stamps: list[float]) -> float:
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return statistics.median(gaps)


# --- the two sides ---------------------------------------------------------------------------
class InProcess:
    """An LLMEngine configured as the cluster's decode worker, in a process of its own (as the worker
    is: the router's and the client's threads are not in it) with the worker's common.environment
    (spec.worker_environment: OpenMP's wait policy among it), stepped by hand."""

    def __init__(self, spec: Any, threads: int) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=_serve_engine, args=(child, spec.engine.model_path,
                                                                spec.engine.cache, spec.engine.scheduler,
                                                                threads), daemon=True)
        # NOTE: a spawned child copies os.environ as it starts; patch.dict restores ours after.
        with mock.patch.dict(os.environ, spec.worker_environment):
            self._process.start()
        ready = self._conn.recv()
        assert ready == "ready", ready

    def run(self, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], list[list[float]]]:
        """Each request's tokens and their arrival times (seconds since the first add_request)."""
        self._conn.send((prompts, new_tokens))
        return self._conn.recv()

    def close(self) -> None:
        self._conn.send(None)
        self._process.join(timeout=30)


def _serve_engine(conn: Any, model_path: str | None, cache: Any, scheduler: Any, threads: int) -> None:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    config = EngineConfig(model_path=model_path, cache=cache, scheduler=scheduler, device="cpu",
                          num_threads=threads)
    engine = LLMEngine.from_config(config, progress=False)
    conn.send("ready")
    while (work := conn.recv()) is not None:
        conn.send(_step_through(engine, *work))


def _step_through(engine: Any, prompts: list[list[int]], new_tokens: int) -> tuple[list, list]:
    from pdserve.engine.sequence import SamplingParams
    greedy = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    ids = [engine.add_request(p, greedy, detokenize=False) for p in prompts]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    stamps: dict[str, list[float]] = {i: [] for i in ids}
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter() - start
        for out in outputs:
            tokens[out.request_id].extend(out.new_token_ids)
            stamps[out.request_id].extend([now] * len(out.new_token_ids))
    assert not engine.leaked_blocks(), "the in-process engine leaked blocks"
    return [tokens[i] for i in ids], [stamps[i] for i in ids]


class ThroughCluster:
    """The public gRPC client against a running cluster's router."""

    def __init__(self, router: str) -> None:
        from pdserve.client import PdserveClient
        self.client = PdserveClient(router, timeout_s=600)

    def one(self, prompt: list[int], new_tokens: int, start: float) -> tuple[list[int], list[float]]:
        tokens: list[int] = []
        stamps: list[float] = []
        with self.client.stream(token_ids=prompt, temperature=0, max_tokens=new_tokens,
                                ignore_eos=True) as stream:
            for response in stream:
                if response.token_ids:
                    tokens.extend(response.token_ids)
                    stamps.extend([time.perf_counter() - start] * len(response.token_ids))
        return tokens, stamps

    def run(self, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], list[list[float]]]:
        """All prompts at once, one client thread each; tokens and arrival times as InProcess.run."""
        results: list[Any] = [None] * len(prompts)
        start = time.perf_counter()

        def call(i: int) -> None:
            results[i] = self.one(prompts[i], new_tokens, start)

        threads = [threading.Thread(target=call, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return [r[0] for r in results], [r[1] for r in results]

    def close(self) -> None:
        self.client.close()


# --- phases ------------------------------------------------------------------------------------
def measure(sides: dict[str, Any], prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """One rep of both sides on the same prompts: first-token times, median gaps, tokens."""
    out: dict[str, Any] = {}
    for name, side in sides.items():
        tokens, stamps = side.run(prompts, new_tokens)
        out[name] = {"tokens": tokens, "ttft": common.median([s[0] for s in stamps]),
                     "itl": common.median([median_gap(s) for s in stamps]) if new_tokens > 1 else None}
    return out


def bench_phase(sides: dict[str, Any], label: str, batch: int, prompt_tokens: int, new_tokens: int,
                reps: int, rng: random.Random) -> dict[str, Any]:
    key = "ttft" if new_tokens == 1 else "itl"
    values: dict[str, list[float]] = {name: [] for name in sides}
    same = True
    for rep in range(reps + 1):  # rep 0 is the warm-up
        common.progress(f"{label}: rep {rep}/{reps}")
        prompts = [random_prompt(rng, prompt_tokens) for _ in range(batch)]
        rep_result = measure(sides, prompts, new_tokens)
        same &= rep_result["cluster"]["tokens"] == rep_result["in_process"]["tokens"]
        if rep:
            for name in sides:
                values[name].append(rep_result[name][key])
    cluster, local = common.median(values["cluster"]), common.median(values["in_process"])
    return {f"{label}_overhead": cluster / local, f"{label}_cluster_ms": 1e3 * cluster,
            f"{label}_in_process_ms": 1e3 * local, f"{label}_greedy_tokens_identical": same}


def run_phases(sides: dict[str, Any], sizes: Sizes, rng: random.Random) -> dict[str, Any]:
    result: dict[str, Any] = {}
    result.update(bench_phase(sides, "ttft", 1, sizes.prompt_tokens, 1, sizes.reps, rng))
    result.update(bench_phase(sides, "itl", 1, ITL_PROMPT_TOKENS, sizes.new_tokens, sizes.reps, rng))
    result.update(bench_phase(sides, "itl_batch", sizes.batch, ITL_PROMPT_TOKENS, sizes.new_tokens,
                              sizes.reps, rng))
    return result


def run(args: Any) -> dict[str, Any]:
    from deploy.config import ClusterSpec
    from pdserve.engine.config import EngineConfig, cpu_threads_per_worker

    base = QUICK if args.quick else Sizes()
    chosen = {k: getattr(args, k) for k in ("prompt_tokens", "new_tokens", "batch", "reps")}
    sizes = replace(base, **{k: v for k, v in chosen.items() if v is not None})
    load_at_start = common.warn_if_busy(len(os.sched_getaffinity(0)))
    threads = args.threads or cpu_threads_per_worker(1)  # default: what LocalCluster gives a lone worker
    spec = ClusterSpec(num_prefill=0, num_decode=1, port=0, namespace="bench-cluster",
                       engine=EngineConfig(num_threads=threads))
    result = compare_on_cluster(
        spec, lambda _, address: {"cluster": ThroughCluster(address), "in_process": InProcess(spec, threads)},
        lambda sides: run_phases(sides, sizes, random.Random(args.seed)))
    return {**result, "threads": threads, "sizes": sizes.__dict__, "quick": args.quick,
            "targets": {"ttft_overhead": f"<= {TARGET_OVERHEAD}", "itl_overhead": f"<= {TARGET_OVERHEAD}"},
            "environment": {**common.environment(threads), "loadavg_at_start": load_at_start}}


def compare_on_cluster(spec: Any, make_sides: Callable[[Any, str], dict[str, Any]],
                       phases: Callable[[dict[str, Any]], dict[str, Any]]) -> dict[str, Any]:
    """Start `pdserve up`'s cluster of `spec`, run `phases` over the sides make_sides(cluster, its router's
    address) builds, then close every side and stop the cluster, whatever happened."""
    from deploy.launcher import LocalCluster

    cluster = LocalCluster(spec, say=lambda line: common.progress(f"cluster: {line}"))
    try:
        sides = make_sides(cluster, cluster.start())
        try:
            return phases(sides)
        finally:
            for side in sides.values():
                side.close()
    finally:
        cluster.stop()


def report(r: dict[str, Any]) -> str:
    rows = []
    for label, what in (("ttft", f"TTFT, {r['sizes']['prompt_tokens']}-token prompt"),
                        ("itl", "ITL, 1 stream"), ("itl_batch", f"ITL, {r['sizes']['batch']} streams")):
        x = r[f"{label}_overhead"]
        rows.append([what, r[f"{label}_cluster_ms"], r[f"{label}_in_process_ms"], x, f"<= {TARGET_OVERHEAD}",
                     "yes" if x <= TARGET_OVERHEAD else "NO", r[f"{label}_greedy_tokens_identical"]])
    load = r["environment"]["loadavg_at_start"]
    head = f"threads={r['threads']} reps={r['sizes']['reps']} load average at start {load:.2f}"
    table = common.format_table(["measure", "cluster ms", "in-process ms", "overhead", "target", "met",
                          "same tokens"], rows)
    return "\n".join([head, table])


def parse_args(argv: list[str] | None = None) -> Any:
    p = common.bench_parser("python -m bench.cluster", __doc__)
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 128-token TTFT prompt, 12 new tokens, 2 streams, 1 rep")
    p.add_argument("--reps", type=int, default=None,
                   help=f"measured repetitions per phase after one warm-up (default {Sizes.reps})")
    p.add_argument("--prompt-tokens", type=int, default=None,
                   help=f"the TTFT prompt's length in tokens (default {Sizes.prompt_tokens})")
    p.add_argument("--new-tokens", type=int, default=None,
                   help=f"tokens generated per stream in the ITL phases (default {Sizes.new_tokens})")
    p.add_argument("--batch", type=int, default=None,
                   help=f"concurrent streams in the batched ITL phase (default {Sizes.batch})")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads of the worker and of the in-process engine alike; fewer than the "
                        "cores leaves the router and clients a core of their own (default: every core)")
    p.add_argument("--seed", type=int, default=0, help="prompt seed (default: %(default)s)")
    least = {"reps": 1, "prompt_tokens": 1, "new_tokens": 2, "batch": 1, "threads": 1}
    return common.check_least(p, p.parse_args(argv), least)


def main(argv: list[str] | None = None) -> None:
    common.run_timed(run, report, parse_args(argv))


if __name__ == "__main__":
    main()
