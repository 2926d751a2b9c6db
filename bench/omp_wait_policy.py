"""OpenMP's wait policy: an engine step with torch's threads spinning at barriers or sleeping.

    python -m bench.omp_wait_policy [--json] [--threads N] [--reps N] [--new-tokens N] [--prompt-tokens N]

torch runs its ops on OpenMP threads, which by default (libgomp, torch's CPU build) spin for a
while at every barrier before they sleep; OMP_WAIT_POLICY=PASSIVE makes them sleep at once.
pdserve's workers get PASSIVE (deploy/config.py DEFAULT_WORKER_ENV). This measures both policies
with SmolLM2's LLMEngine at --threads torch threads (default: every core):

  decode   median step time of a batch-1 greedy decode of --new-tokens tokens after a 56-token prompt
  decode4  the same with 4 such requests decoding together
  prefill  time to the first token of a fresh --prompt-tokens prompt (max_tokens=1)

each on a quiet machine and beside one busy process (a Python loop on one core: what a router,
a client or another worker is to a worker sharing its cores). The policy is read when torch
loads, so every measurement runs in a fresh child process (this module with --child) whose
environment sets it or leaves it unset; the policies alternate rep by rep, medians of --reps.

Headlines: passive_decode_ratio_quiet / _busy, passive_decode4_ratio_quiet / _busy and
passive_prefill_ratio_quiet / _busy = PASSIVE's time / the default's (below 1: PASSIVE faster).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

from bench.common import bench_parser, format_table, median, progress, run_timed

POLICIES = {"default": None, "passive": "PASSIVE"}  # None: OMP_WAIT_POLICY unset, libgomp's spinning
LOADS = ("quiet", "busy")
MEASURES = ("decode_step", "decode4_step", "prefill")  # each child's figures, in seconds as <name>_s


@contextlib.contextmanager
def busy_process(on: bool) -> Iterator[None]:
    """One process spinning on a core while the block runs (nothing when `on` is False)."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if on else None
    try:
        yield
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()


def child_environment(policy: str, base: dict[str, str]) -> dict[str, str]:
    """base with OMP_WAIT_POLICY as `policy` names it (unset for the default, whatever base had)."""
    env = {k: v for k, v in base.items() if k != "OMP_WAIT_POLICY"}
    if POLICIES[policy] is not None:
        env["OMP_WAIT_POLICY"] = POLICIES[policy]
    return env


def measure_in_child(policy: str, args: argparse.Namespace) -> dict[str, float]:
    env = child_environment(policy, dict(os.environ))
    command = [sys.executable, "-m", "bench.omp_wait_policy", "--child", "--threads", str(args.threads),
               "--new-tokens", str(args.new_tokens), "--prompt-tokens", str(args.prompt_tokens)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def child(args: argparse.Namespace) -> None:
    """One measurement of each of MEASURES in this process, as JSON on stdout."""
    import random
    import time

    import torch

    from bench.engine import Ours, random_prompt
    from pdserve.engine.weights import load_model

    torch.set_num_threads(args.threads)
    ours = Ours(load_model(None, progress=False), 512, 16, args.threads)
    rng = random.Random(0)
    ours.stream(random_prompt(rng, 56), 4)  # warm the code paths
    ours.reset()

    def decode_step_s(batch: int) -> float:
        for _ in range(batch):
            ours.engine.add_request(random_prompt(rng, 56), ours.greedy(args.new_tokens), detokenize=False)
        ours.engine.step()  # the prefills
        steps: list[float] = []
        while ours.engine.has_unfinished():
            started = time.perf_counter()
            ours.engine.step()
            steps.append(time.perf_counter() - started)
        ours.reset()
        return median(steps)

    decode, decode4 = decode_step_s(1), decode_step_s(4)
    prefill_s, _ = ours.ttft(random_prompt(rng, args.prompt_tokens))
    ours.reset()
    print(json.dumps({"decode_step_s": decode, "decode4_step_s": decode4, "prefill_s": prefill_s}))


def run(args: argparse.Namespace) -> dict[str, Any]:
    load_at_start = os.getloadavg()[0]
    samples: dict[tuple[str, str], list[dict[str, float]]] = {(p, ld): [] for p in POLICIES for ld in LOADS}
    for load in LOADS:
        with busy_process(load == "busy"):
            for rep in range(args.reps):
                order = list(POLICIES) if rep % 2 == 0 else list(reversed(POLICIES))
                for policy in order:
                    progress(f"{load}: rep {rep + 1}/{args.reps}, {policy}")
                    samples[(policy, load)].append(measure_in_child(policy, args))
    result: dict[str, Any] = {"threads": args.threads, "reps": args.reps, "new_tokens": args.new_tokens,
                              "prompt_tokens": args.prompt_tokens, "loadavg_at_start": load_at_start,
                              "cpu_cores": len(os.sched_getaffinity(0))}
    for (policy, load), runs in samples.items():
        for what in MEASURES:
            result[f"{policy}_{what}_ms_{load}"] = 1e3 * median([r[f"{what}_s"] for r in runs])
    for load in LOADS:
        for what in MEASURES:
            result[ratio_key(what, load)] = (
                result[f"passive_{what}_ms_{load}"] / result[f"default_{what}_ms_{load}"])
    return result


def ratio_key(what: str, load: str) -> str:
    """passive_decode_ratio_quiet, passive_decode4_ratio_busy, passive_prefill_ratio_quiet, ..."""
    return f"passive_{what.removesuffix('_step')}_ratio_{load}"


def report(r: dict[str, Any]) -> str:
    rows = [[load, what, f"{r[f'default_{what}_ms_{load}']:.1f}", f"{r[f'passive_{what}_ms_{load}']:.1f}",
             f"{r[ratio_key(what, load)]:.2f}"] for load in LOADS for what in MEASURES]
    head = f"threads={r['threads']} reps={r['reps']} loadavg_at_start={r['loadavg_at_start']:.2f}\n"
    return head + format_table(["machine", "measure", "default ms", "passive ms", "passive / default"], rows)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = bench_parser("python -m bench.omp_wait_policy", __doc__)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="torch intra-op threads of the engine (default: one per usable core)")
    p.add_argument("--reps", type=int, default=3, help="measurements per policy and machine state, medians "
                                                       "reported (default: 3)")
    p.add_argument("--new-tokens", type=int, default=48,
                   help="decode steps timed per measurement (default: 48)")
    p.add_argument("--prompt-tokens", type=int, default=512,
                   help="tokens of the prefill's prompt (default: 512)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        child(args)
    else:
        run_timed(run, report, args)


if __name__ == "__main__":
    main()
