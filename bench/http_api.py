"""What the HTTP front door adds: the same requests over the OpenAI API and over gRPC, one cluster.

    python -m bench.http_api [--json] [--quick] [--reps N] [--requests N] [--new-tokens N]

Cluster: LocalCluster (what `pdserve up` starts) with 0 prefill and 1 decode worker, its HTTP API
on a free port. The two sides are the public gRPC client (bench.cluster's ThroughCluster) and an
httpx client streaming /v1/completions with the same token-id prompt, greedy, ignore_eos and
return_token_ids, so both sides get the same tokens; each is timed on the client side as its
tokens arrive.

  ttft   --requests fresh random 128-token prompts a rep and side (never one the other side
         sent: that would be a prefix-cache hit), max_tokens=1, one at a time, the sides taking
         turns to go first
  itl    one stream of --new-tokens tokens a rep, the same prompt on both sides (its tokens are
         compared), the side that goes first changing every rep: every gap between tokens

After a warm-up rep, percentiles are over every sample of every rep. Headlines:
http_ttft_ratio_p50/p99 and http_itl_ratio_p50/p99, HTTP ÷ gRPC; targets ≤ 1.05 at p50 and ≤ 1.10
at p99 (issue 16).
"""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import dataclass, replace
from typing import Any

from bench.cluster import ThroughCluster, compare_on_cluster
from bench.common import (
    bench_parser,
    check_least,
    environment,
    format_table,
    progress,
    run_timed,
    warn_if_busy,
)
from bench.engine import random_prompt
from deploy.redis_server import free_port
from loadtest.stats import percentile

TARGETS = {"p50": 1.05, "p99": 1.10}
TTFT_PROMPT_TOKENS = 128
ITL_PROMPT_TOKENS = 32


@dataclass(frozen=True)
class Sizes:
    requests: int = 20  # TTFT requests per side per rep
    new_tokens: int = 64
    reps: int = 3


QUICK = Sizes(requests=4, new_tokens=12, reps=1)


class OverHttp:
    """/v1/completions, streamed, through the router's HTTP API."""

    def __init__(self, url: str, model: str) -> None:
        import httpx
        self.url, self.model = url + "/v1/completions", model
        self.client = httpx.Client(timeout=600)

    def one(self, prompt: list[int], new_tokens: int, start: float) -> tuple[list[int], list[float]]:
        body = {"model": self.model, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True, "stream": True}
        tokens: list[int] = []
        stamps: list[float] = []
        with self.client.stream("POST", self.url, json=body) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ids = [t for c in json.loads(line[6:])["choices"] for t in c.get("token_ids", ())]
                tokens.extend(ids)
                stamps.extend([time.perf_counter() - start] * len(ids))
        return tokens, stamps

    def close(self) -> None:
        self.client.close()


def ttft_samples(sides: dict[str, Any], prompts: dict[str, list[list[int]]]) -> dict[str, list[float]]:
    """Each side its own fresh prompts, in turns. NOTE: a prompt the other side just sent would be a
    prefix-cache hit, and time a cached prefill against a cold one."""
    out: dict[str, list[float]] = {name: [] for name in sides}
    for turn, _ in enumerate(prompts["http"]):
        for name in in_turn(sides, turn):
            _, stamps = sides[name].one(prompts[name][turn], 1, time.perf_counter())
            out[name].append(stamps[0])
    return out


def in_turn(sides: dict[str, Any], turn: int) -> list[str]:
    """The side names, the first one changing every turn, so neither always runs right after the other."""
    names = list(sides)
    return names if turn % 2 == 0 else names[::-1]


def itl_samples(sides: dict[str, Any], prompt: list[int], new_tokens: int,
                turn: int) -> tuple[dict[str, list[float]], bool]:
    out, tokens = {}, {}
    for name in in_turn(sides, turn):
        tokens[name], stamps = sides[name].one(prompt, new_tokens, time.perf_counter())
        out[name] = [b - a for a, b in zip(stamps, stamps[1:])]
    return out, tokens["http"] == tokens["grpc"]


def run_phases(sides: dict[str, Any], sizes: Sizes, rng: random.Random) -> dict[str, Any]:
    ttft: dict[str, list[float]] = {name: [] for name in sides}
    itl: dict[str, list[float]] = {name: [] for name in sides}
    same = True
    for rep in range(sizes.reps + 1):  # rep 0 is the warm-up
        progress(f"rep {rep}/{sizes.reps}")
        prompts = {name: [random_prompt(rng, TTFT_PROMPT_TOKENS) for _ in range(sizes.requests)]
                   for name in sides}
        t = ttft_samples(sides, prompts)
        i, same_i = itl_samples(sides, random_prompt(rng, ITL_PROMPT_TOKENS), sizes.new_tokens, rep)
        same &= same_i
        if rep:
            for name in sides:
                ttft[name] += t[name]
                itl[name] += i[name]
    result: dict[str, Any] = {"greedy_tokens_identical": same}
    for label, samples in (("ttft", ttft), ("itl", itl)):
        for q in ("p50", "p99"):
            http, grpc = (percentile(samples[n], int(q[1:])) for n in ("http", "grpc"))
            result[f"http_{label}_ratio_{q}"] = http / grpc
            result[f"{label}_{q}_ms"] = {"http": 1e3 * http, "grpc": 1e3 * grpc}
    return result



def run(args: Any) -> dict[str, Any]:
    from deploy.config import ClusterSpec

    base = QUICK if args.quick else Sizes()
    chosen = {k: getattr(args, k) for k in ("requests", "new_tokens", "reps")}
    sizes = replace(base, **{k: v for k, v in chosen.items() if v is not None})
    load_at_start = warn_if_busy(len(os.sched_getaffinity(0)))
    spec = ClusterSpec(num_prefill=0, num_decode=1, port=0, http_port=free_port(), namespace="bench-http")

    def sides(cluster: Any, address: str) -> dict[str, Any]:
        return {"grpc": ThroughCluster(address),
                "http": OverHttp(cluster.router.http_url, cluster.router.config.served_model_name)}

    result = compare_on_cluster(spec, sides, lambda both: run_phases(both, sizes, random.Random(args.seed)))
    threads = os.cpu_count() or 1
    return {**result, "sizes": sizes.__dict__, "quick": args.quick,
            "targets": {f"http_{m}_ratio_{q}": f"<= {t}" for m in ("ttft", "itl")
                        for q, t in TARGETS.items()},
            "environment": {**environment(threads), "loadavg_at_start": load_at_start}}


def report(r: dict[str, Any]) -> str:
    rows = []
    for label in ("ttft", "itl"):
        for q, target in TARGETS.items():
            x = r[f"http_{label}_ratio_{q}"]
            ms = r[f"{label}_{q}_ms"]
            rows.append([f"{label.upper()} {q}", ms["http"], ms["grpc"], x, f"<= {target}",
                         "yes" if x <= target else "NO"])
    load = r["environment"]["loadavg_at_start"]
    head = (f"reps={r['sizes']['reps']} ttft requests/rep={r['sizes']['requests']} "
            f"new tokens={r['sizes']['new_tokens']} load average at start {load:.2f} "
            f"same tokens={r['greedy_tokens_identical']}")
    return "\n".join([head, format_table(["measure", "HTTP ms", "gRPC ms", "ratio", "target", "met"], rows)])


def parse_args(argv: list[str] | None = None) -> Any:
    p = bench_parser("python -m bench.http_api", __doc__)
    p.add_argument("--quick", action="store_true", help="smoke run: 4 TTFT requests, 12 new tokens, 1 rep")
    p.add_argument("--reps", type=int, default=None,
                   help=f"measured repetitions after one warm-up (default {Sizes.reps})")
    p.add_argument("--requests", type=int, default=None,
                   help=f"TTFT requests per side per rep (default {Sizes.requests})")
    p.add_argument("--new-tokens", type=int, default=None,
                   help=f"tokens of the ITL stream, per side per rep (default {Sizes.new_tokens})")
    p.add_argument("--seed", type=int, default=0, help="prompt seed (default: %(default)s)")
    return check_least(p, p.parse_args(argv), {"reps": 1, "requests": 1, "new_tokens": 2})


def main(argv: list[str] | None = None) -> None:
    run_timed(run, report, parse_args(argv))


if __name__ == "__main__":
    main()
