"""What the host and disk KV tiers buy: TTFT of a prefix loaded back instead of recomputed, and the
prefix hit rate and throughput of a multi-turn workload larger than the device pool, on SmolLM2.

    python -m bench.kv_tiers [--json] [--quick] [--threads N] [--reps N] [--prompt-tokens N]

In-process LLMEngine on SmolLM2-135M-Instruct (the embedded GGUF), float32 cache, blocks of 16:

  TTFT          a --prompt-tokens prompt (random token ids) shares all but its last block with a
                prompt computed before; the time to its first token (max_tokens=1) when that prefix
                is: not cached (cold recompute), in the device pool (device), evicted to the host
                tier (host: the pool holds one such prompt, and another one pushed it out), or
                evicted through a one-slot host tier to the disk tier (disk). Ratios to cold:
                host_ttft_ratio (target <= 0.10) and disk_ttft_ratio (<= 0.25).
  reload weight the router's cost of a lower-tier block as a fraction of recomputing it:
                (ttft_tier - ttft_device) / (ttft_cold - ttft_device), for host and disk. These are the
                figures router/scoring.py's ScoringWeights.host_reload / disk_reload should carry.
  multi-turn    --conversations chats of --turns turns (each turn adds --turn-tokens user tokens and
                8 generated tokens), served round-robin, one request at a time, with a device pool of a
                third of their final working set: with a host tier that holds the rest, and without.
                host_tier_hit_rate_ratio = (cached / prompt tokens, with) / (the same, without),
                target >= 2; host_tier_throughput_ratio = tokens per second, with / without.

Medians of --reps runs (>= 3). The load average is recorded: on a shared machine the TTFTs are
noisy; the ratios of two runs side by side less so.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch

from bench import common

BLOCK_SIZE = 16
TARGETS = {"host_ttft_ratio": 0.10, "disk_ttft_ratio": 0.25, "host_tier_hit_rate_ratio": 2.0}


@dataclass(frozen=True)
class Sizes:
    prompt_tokens: int = 2048
    conversations: int = 6
    turns: int = 4
    turn_tokens: int = 64


FULL, QUICK = Sizes(), Sizes(prompt_tokens=512, conversations=4, turns=3, turn_tokens=48)
GEN_TOKENS = 8


def make_engine(loaded, num_blocks: int, host_blocks: int | None = None, disk_dir: str | None = None):
    from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from pdserve.engine.llm_engine import LLMEngine
    cache = CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks, host_num_blocks=host_blocks,
                        disk_cache_dir=disk_dir)
    return LLMEngine(loaded, EngineConfig(cache=cache, scheduler=SchedulerConfig(max_num_batched_tokens=4096),
                                          device="cpu"))


def ttft(engine, prompt: list[int]) -> tuple[float, Any]:
    from pdserve.engine.sequence import SamplingParams
    started = time.perf_counter()
    result = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
                             detokenize=False)[0]
    return time.perf_counter() - started, result.usage


def ttft_case(loaded, n: int, g: torch.Generator, case: str, disk_dir: str) -> float:
    """One TTFT measurement of a prompt of n tokens whose first n - BLOCK_SIZE tokens are `case`."""
    vocab = loaded.config.vocab_size
    rand = lambda k: torch.randint(0, vocab, (k,), generator=g).tolist()  # noqa: E731
    prefix, tail, other = rand(n - BLOCK_SIZE), rand(BLOCK_SIZE), rand(n + 2 * BLOCK_SIZE - 1)
    blocks = n // BLOCK_SIZE + 2  # one prompt and its first token; `other` needs them all: the prefix goes
    host = {"host": blocks, "disk": 1}.get(case)
    engine = make_engine(loaded, blocks, host, disk_dir if case == "disk" else None)
    ttft(engine, rand(BLOCK_SIZE * 2))  # warm the engine's code paths
    if case != "cold":
        ttft(engine, prefix + rand(BLOCK_SIZE))
    if case in ("host", "disk"):
        ttft(engine, other)  # evicts the prefix: into host, or through one host slot to disk
    seconds, usage = ttft(engine, prefix + tail)
    expected = {"cold": 0, "device": 0}.get(case, len(prefix))
    got = {"host": usage.host_cached_tokens, "disk": usage.host_cached_tokens + usage.disk_cached_tokens}
    if case in got and got[case] < expected:
        raise RuntimeError(f"{case}: only {got[case]} of {len(prefix)} prefix tokens came back from the tier")
    return seconds


def multi_turn(loaded, s: Sizes, with_host: bool, seed: int) -> dict[str, float]:
    from pdserve.engine.sequence import SamplingParams
    g = torch.Generator().manual_seed(seed)
    vocab = loaded.config.vocab_size
    final_tokens = s.turns * (s.turn_tokens + GEN_TOKENS)
    working_set = s.conversations * (final_tokens // BLOCK_SIZE + 1)
    device = max(working_set // 3, final_tokens // BLOCK_SIZE + 2)
    engine = make_engine(loaded, device, 2 * working_set if with_host else None)
    histories: list[list[int]] = [[] for _ in range(s.conversations)]
    prompt = cached = generated = 0
    greedy = SamplingParams(temperature=0, max_tokens=GEN_TOKENS, ignore_eos=True)
    started = time.perf_counter()
    for _ in range(s.turns):
        for history in histories:
            history += torch.randint(0, vocab, (s.turn_tokens,), generator=g).tolist()
            r = engine.generate([history], greedy, detokenize=False)[0]
            history += r.token_ids
            prompt += r.usage.prompt_tokens
            cached += r.usage.cached_tokens
            generated += len(r.token_ids)
    wall = time.perf_counter() - started
    if engine.leaked_blocks():
        raise RuntimeError(f"blocks leaked: {engine.leaked_blocks()}")
    return {"hit_rate": cached / prompt, "tokens_per_s": (prompt + generated) / wall,
            "device_blocks": device, "working_set_blocks": working_set}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from pdserve.engine.weights import load_model
    from router.scoring import ScoringWeights
    threads = common.set_threads(args.threads)
    load = common.warn_if_busy(threads)
    sizes = QUICK if args.quick else FULL
    if args.prompt_tokens is not None:
        sizes = Sizes(args.prompt_tokens, sizes.conversations, sizes.turns, sizes.turn_tokens)
    loaded = load_model(None, progress=False)
    times: dict[str, list[float]] = {c: [] for c in ("cold", "device", "host", "disk")}
    with tempfile.TemporaryDirectory(prefix="pdserve-kv-tiers-") as tmp:
        for rep in range(args.reps):
            for case in times:
                common.progress(f"TTFT rep {rep + 1}/{args.reps}: {case}")
                g = torch.Generator().manual_seed(rep)
                times[case].append(ttft_case(loaded, sizes.prompt_tokens, g, case, f"{tmp}/{rep}"))
    t = {c: common.median(v) for c, v in times.items()}
    runs = {True: [], False: []}
    for rep in range(args.reps):
        for with_host in (True, False):
            common.progress(f"multi-turn rep {rep + 1}/{args.reps}: host tier {'on' if with_host else 'off'}")
            runs[with_host].append(multi_turn(loaded, sizes, with_host, seed=100 + rep))
    on = {k: common.median([r[k] for r in runs[True]]) for k in ("hit_rate", "tokens_per_s")}
    off = {k: common.median([r[k] for r in runs[False]]) for k in ("hit_rate", "tokens_per_s")}
    weight = lambda tier: max(0.0, (t[tier] - t["device"]) / (t["cold"] - t["device"]))  # noqa: E731
    result: dict[str, Any] = {
        "prompt_tokens": sizes.prompt_tokens, "reps": args.reps,
        **{f"ttft_{c}_s": v for c, v in t.items()},
        "host_ttft_ratio": t["host"] / t["cold"], "disk_ttft_ratio": t["disk"] / t["cold"],
        "host_reload_weight": weight("host"), "disk_reload_weight": weight("disk"),
        "router_host_reload": ScoringWeights().host_reload,
        "router_disk_reload": ScoringWeights().disk_reload,
        "hit_rate_with_host": on["hit_rate"], "hit_rate_without": off["hit_rate"],
        "host_tier_hit_rate_ratio": on["hit_rate"] / off["hit_rate"] if off["hit_rate"] else float("inf"),
        "tokens_per_s_with_host": on["tokens_per_s"], "tokens_per_s_without": off["tokens_per_s"],
        "host_tier_throughput_ratio": on["tokens_per_s"] / off["tokens_per_s"],
        "device_blocks": runs[True][0]["device_blocks"],
        "working_set_blocks": runs[True][0]["working_set_blocks"],
        "loadavg_before": load, **common.environment(threads),
    }
    result["targets_met"] = {k: (result[k] >= v if k.endswith("hit_rate_ratio") else result[k] <= v)
                             for k, v in TARGETS.items()}
    return result


def report(r: dict[str, Any]) -> str:
    ttft_rows = [[c, r[f"ttft_{c}_s"] * 1000, r[f"ttft_{c}_s"] / r["ttft_cold_s"]]
                 for c in ("cold", "device", "host", "disk")]
    lines = [f"TTFT of a {r['prompt_tokens']:,}-token prompt, median of {r['reps']} (load average "
             f"{r['loadavg_1min']:.2f}):", common.format_table(["prefix", "ms", "x cold"], ttft_rows),
             f"reload / recompute, measured: host {r['host_reload_weight']:.4f}, "
             f"disk {r['disk_reload_weight']:.4f}"
             f"  (router/scoring.py uses host_reload={r['router_host_reload']}, "
             f"disk_reload={r['router_disk_reload']})",
             f"multi-turn, working set {r['working_set_blocks']} blocks, device pool {r['device_blocks']}:",
             common.format_table(["host tier", "hit rate", "tokens/s"],
                          [["on", r["hit_rate_with_host"], r["tokens_per_s_with_host"]],
                           ["off", r["hit_rate_without"], r["tokens_per_s_without"]]]),
             f"hit rate x{r['host_tier_hit_rate_ratio']:.2f}, "
             f"throughput x{r['host_tier_throughput_ratio']:.2f}; "
             f"targets met: {r['targets_met']}"]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common.bench_parser("python -m bench.kv_tiers", __doc__)
    p.add_argument("--quick", action="store_true", help="smoke run: a 512-token prompt, 4 chats of 3 turns")
    common.add_threads_flag(p)
    p.add_argument("--reps", type=int, default=3, help="runs per figure, medians reported (default: 3)")
    p.add_argument("--prompt-tokens", type=int,
                   help=f"the TTFT prompt's tokens (default: {FULL.prompt_tokens})")
    least = {"reps": 1, "prompt_tokens": 2 * BLOCK_SIZE, "threads": 1}
    return common.check_least(p, p.parse_args(argv), least)


def main(argv: list[str] | None = None) -> None:
    common.run_timed(run, report, parse_args(argv))


if __name__ == "__main__":
    main()
